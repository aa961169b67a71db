"""`gadei learn`: one learner of a job (the program itself: `gadei.trainer`)."""

from .common import add_job_file, add_workload, at_least, train_value


def cmd_learn(args) -> int:
    from ..trainer import run

    return run(args)


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="train a built-in workload as one learner of a job",
                       description="Attach to a served job and train a built-in workload on one shard of "
                       "its data, pushing every gradient and pulling new weights. A loss that turns NaN or infinite "
                       "does not stop it (its --json epoch records say loss NaN or Infinity): stopping on it is "
                       "`gadei run`'s alone, which stops the whole job (the supervisor restarts a learner that exits "
                       "with an error). "
                       "To stop such a job, serve it with `--nonfinite stop`: the server fails the job on the first "
                       "non-finite gradient with the reason, and every learner exits 2 with it.")
    p.add_argument("job")
    add_job_file(p)
    add_workload(p, required=False)
    p.set_defaults(workload="textcnn")
    p.add_argument("--epochs", type=train_value("epochs"), default=1,
                   help="passes over this learner's shard (default 1)")
    p.add_argument("--batch", type=train_value("batch"), default=2, help="mini-batch size (default 2)")
    p.add_argument("--shard", default="0/1", help="INDEX/COUNT: this learner's share of the data (default 0/1)")
    p.add_argument("--device", default="cpu", help="where this learner trains: cpu (default), cuda or cuda:N "
                   "(device transports: staging on the GPU, copy streams, a page-locked region)")
    p.add_argument("--pull", choices=("view", "copy", "local", "device"), default=None,
                   help="how weights reach the model: view (shared, Hogwild), copy (pull thread) or local "
                   "(elastic); default: the job's mode decides (view; copy when consistent; local when elastic)")
    p.add_argument("--push", choices=("publish", "thread", "weights", "device"), default=None,
                   help="how gradients reach the ring: publish (default), thread, weights (elastic, the default there)")
    p.add_argument("--entry", type=int, default=None, metavar="N",
                   help="take learner entry N (its ring and its number) when it is free or its owner died, else the "
                        "first free: how a job's supervisor and gadei demo give launched learner N the number N "
                        "in its log and in gadei status")
    p.add_argument("--eval", action="store_true", help="evaluate on the test set after every epoch")
    p.add_argument("--validate", action="store_true",
                   help="after every epoch evaluate on the job's validation set (--data job:JOBFILE), keep the best "
                   "model in --best and, with --patience, end the job's training for every learner when it stopped "
                   "improving (one learner of a job does this)")
    p.add_argument("--patience", type=int, default=0,
                   help="--validate: evaluations without improvement that end training (default 0: never; "
                   "--job-file: its [train] patience)")
    p.add_argument("--best", metavar="FOLDER", help="--validate: where the best model (best.pt) and the selection's "
                   "state (best.json) are kept, crash safely (a restarted learner goes on with them)")
    p.add_argument("--torch-threads", type=at_least(1), default=1, metavar="N",
                   help="PyTorch intra-op threads (default 1; --job-file: its [train] threads, where \"auto\" is "
                   "the cores less one for the server, shared by the job's learners)")
    p.add_argument("--start-at", type=int, default=0, metavar="SAMPLES",
                   help="skip this many samples of the schedule (epochs x shard): a restarted learner goes on "
                   "where its gradients in the weights end (the supervisor sets it)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of text")
    p.add_argument("--records", metavar="FILE", help="append each epoch's and evaluation's record to FILE as a "
                   "JSON line too (how the job's supervisor follows its evaluating learner)")
    p.set_defaults(func=cmd_learn)
