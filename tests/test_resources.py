"""The daemon places jobs by what they need (`gadei.daemon.resources`, `--max-jobs auto`): a
job starts when its cores, memory and shared memory are free, by [job] priority then submit
order; one that waits says what for; one that could never fit is refused at submit."""

import textwrap

import numpy as np
import pytest

from helpers import communicate, daemon_jobs, finish, small_job, start_daemon, unique_name, wait_for
from gadei.daemon import resources
from gadei.daemon.resources import Need, Sizes


def test_a_jobs_need_counts_its_learners_threads_and_its_server_at_most_the_cores():
    sizes = Sizes(learners=2, threads=0, region=10 << 20, processes=900 << 20)
    assert sizes.need(cores=2, share=2) == Need(2, 910 << 20, 10 << 20)  # 2 x 1 thread + the server: all 2 cores
    assert sizes.need(cores=16, share=16) == Need(15, 910 << 20, 10 << 20)  # auto: 7 threads a learner
    assert sizes.need(cores=16, share=4) == Need(3, 910 << 20, 10 << 20)  # a share of 4: 1 thread a learner
    assert Sizes(2, 3, 0, 0).need(cores=16, share=4).cores == 7  # its file's threads, whatever its share
    # the share: an equal part of the cores among the jobs that wait and run, at least a learner's
    # thread each and the server's core, at most every core
    assert [resources.share(16, 2, jobs) for jobs in (1, 2, 4, 8)] == [16, 8, 4, 3]
    assert resources.share(2, 2, 8) == 2


def test_what_a_job_waits_for_and_why_one_could_never_start_are_said():
    need = Need(3, 2 << 30, 64 << 20)
    assert need.short(Need(1, 8 << 30, 1 << 30)) == "needs 3 cores, 1 free"
    assert need.short(Need(4, 1 << 30, 1 << 30)) == "needs 2.0 GiB of memory, 1.0 GiB free"
    assert need.short(Need(4, 8 << 30, 1 << 20)) == "needs 64 MiB of shared memory, 1 MiB free"
    assert need.short(Need(3, 2 << 30, 64 << 20)) is None
    room = resources.room()
    assert resources.never(Need(1, 1, 1)) is None
    assert "of memory and this machine (or its cgroup) has" in resources.never(Need(1, room.memory + 1, 1))
    assert f"of shared memory and {resources.SHM} holds" in resources.never(Need(1, 1, room.shm + 1))
    free = resources.free([Need(1, 1 << 20, 1 << 20)])
    assert free.cores == room.cores - 1 and free.memory <= room.memory - (1 << 20)


def _job(folder, name: str, epochs: int, priority: int = 0) -> str:
    path = folder / f"{name}.toml"
    body = textwrap.dedent(small_job(name)).replace('workload = "textcnn"\n',
                                                     f'workload = "textcnn"\npriority = {priority}\n')
    path.write_text(body + f"\n[train]\nlearners = 2\nepochs = {epochs}\npatience = {epochs}\n\n"
                    f"[output]\nfolder = \"out-{name}\"\n")
    return path


def test_a_job_that_does_not_fit_waits_saying_why_and_a_higher_priority_one_starts_first(small, procs, daemon_env):
    """On 2 cores (GADEI_CORES: whatever the machine), a job of 2 learners takes them all: the
    next waits, `gadei status` says for what, and of two waiting jobs the one of the higher
    [job] priority starts first, though submitted later."""
    env = {**daemon_env, "GADEI_CORES": "2"}
    daemon = start_daemon(procs, env)
    first, low, high = unique_name("pfirst"), unique_name("plow"), unique_name("phigh")
    finish(procs.gadei("submit", _job(small, first, epochs=100_000), env=env))  # until it is cancelled
    wait_for(lambda: daemon_jobs(procs, env)[first]["state"] == "running", 120, "the first job to start")
    finish(procs.gadei("submit", _job(small, low, epochs=1), env=env))
    finish(procs.gadei("submit", _job(small, high, epochs=1, priority=5), env=env))
    wait_for(lambda: daemon_jobs(procs, env)[low]["message"].startswith("waiting: "), 60, "the low job to wait")
    jobs = daemon_jobs(procs, env)
    assert jobs[low]["state"] == jobs[high]["state"] == "queued", jobs
    assert jobs[low]["message"] == "waiting: needs 2 cores, 0 free", jobs[low]
    status, _ = finish(procs.gadei("status", env=env))
    assert "waiting: needs 2 cores, 0 free" in status, status
    finish(procs.gadei("cancel", first, env=env))
    wait_for(lambda: all(daemon_jobs(procs, env)[n]["state"] == "done" for n in (low, high)), 300, "both to finish")
    jobs = daemon_jobs(procs, env)
    assert jobs[high]["started"] < jobs[low]["started"], jobs
    daemon.terminate()
    communicate(daemon, 60)


@pytest.mark.parametrize("workload, transport", [("ngram", ""), ("textcnn", ""), ("ngram", "row_sparse = false\n"),
                                                 ("ngram", "max_rows = 50\n")])
def test_a_jobs_region_is_sized_as_its_server_makes_it(small, procs, job, workload, transport):
    """What the daemon reserves of /dev/shm for a job is the region its server makes: an
    embedding table of sparse gradients travels as `max_rows` rows a slot, not the whole table
    (an n-gram job of a large vocabulary was sized as if dense, several times its region)."""
    from gadei import jobfile
    from gadei.prepare import check
    from gadei.region import inspect
    from gadei_workloads.cost import estimate

    path = small / "job.toml"
    path.write_text(small_job(job).replace('"textcnn"', f'"{workload}"') +
                    f"[train]\nlearners = 2\n[transport]\n{transport}")
    prepared = check(jobfile.load(path), False)
    sizes = resources.sizes(prepared.job, estimate(workload, prepared.train), 0)
    (small / "as-run.toml").write_text(prepared.job.to_toml())
    server = procs.gadei("serve", job, "--job-file", small / "as-run.toml", "--learners", 2)  # as its supervisor does
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 120, "the server to serve")
    made = inspect(job).size
    server.terminate()
    finish(server, 60)
    assert sizes.region == made


_MEASURE = """
import gc, sys
import psutil
from gadei import data, jobfile
import gadei_workloads.text  # what reading the data imports, before the count starts

job = jobfile.load(sys.argv[1])
gc.collect()
before = psutil.Process().memory_info().rss
sets = data.load_job(job)
gc.collect()
print(psutil.Process().memory_info().rss - before, data.footprint(sets))
"""


def _texts_job(folder, name: str, rows: int, also: tuple = ()) -> str:
    """A text CNN job of `rows` sentences of 10 words drawn from 2,000, the first ones holding
    every word: the same vocabulary, model and region, whatever `rows`; and one of each workload
    `also` on the same data (NAME-WORKLOAD.toml)."""
    rng = np.random.default_rng(rows)
    words = np.array([f"w{i}" for i in range(2_000)])
    every = np.tile(np.arange(len(words)).reshape(-1, 10), (20, 1))  # in train, whatever is held out
    drawn = np.concatenate([every, rng.integers(0, len(words), (rows, 10))])
    with open(folder / f"{name}.csv", "w") as out:
        out.write("text,label\n")
        for row, label in zip(drawn, rng.integers(0, 4, len(drawn))):
            out.write(f"{' '.join(words[row])},l{label}\n")
    for named, each in ((name, "textcnn"), *((f"{name}-{workload}", workload) for workload in also)):
        (folder / f"{named}.toml").write_text(f'[job]\nname = "{named}"\nworkload = "{each}"\n[data]\n'
                                              f'train = "{name}.csv"\n[train]\nbatch = 4\n[output]\n'
                                              f'folder = "out-{named}"\n')
    return folder / f"{name}.toml"


def test_a_jobs_memory_counts_its_data_sets_as_a_process_holds_them(tmp_path, procs):
    """A job's memory need counts its data sets: DATA_COPIES times what one process holds of
    them (`gadei.data.footprint`), which is what reading them costs a process; a job of a large
    set needs that much more than the same job of a small one (every job was counted 300 MiB a
    process, whatever its data: a job of a 100 MB CSV holds several GiB). A job that picks its
    model counts every candidate's sets (its supervisor holds them all as it goes)."""
    from gadei.daemon.jobs import Jobs

    small, large = _texts_job(tmp_path, "few", 1_000, also=("auto", "ngram")), _texts_job(tmp_path, "many", 250_000)
    (_, counted_few), (grown, counted) = ((int(n) for n in finish(procs.start("-c", _MEASURE, path), 300)[0].split())
                                          for path in (small, large))
    assert 30 << 20 < counted and 0.75 < counted / grown < 1.5, (grown >> 20, counted >> 20)  # MiB
    (tmp_path / "state" / "jobs").mkdir(parents=True)
    jobs = Jobs(tmp_path / "state")
    few, many = (Sizes(**jobs.submit(str(path)).sizes) for path in (small, large))
    assert few.learners == many.learners and few.region == many.region  # one model
    assert many.processes - few.processes == resources.DATA_COPIES * (counted - counted_few), (few, many)
    # the auto job's largest candidate here is its text CNN, and beside its sets it counts the n-gram model's
    measured = finish(procs.start("-c", _MEASURE, tmp_path / "few-ngram.toml"), 300)[0]
    counted_ngrams = int(measured.split()[1])
    auto = Sizes(**jobs.submit(str(tmp_path / "few-auto.toml")).sizes)
    assert auto.region == few.region and auto.processes - few.processes == resources.DATA_COPIES * counted_ngrams, \
        (auto, few)
