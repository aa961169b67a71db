"""Job files: parsing, defaults, every refusal (before anything starts), every data format on
small files, and `gadei run` end to end on TREC."""

import json
import os
import signal
import subprocess
import textwrap
import tomllib

import pytest
import torch

from helpers import blobs, blobs_job, communicate, job_version, small_job, trec_job, unique_name, wait_for
from gadei import data, jobfile
from gadei_workloads import get as get_workload
from gadei.errors import GadeiError
from gadei.jobfile import JobFileError
from gadei.region import inspect
from gadei.server_record import read_stop_record



def _csv(folder, rows, name="train.csv", header="text,category"):
    path = folder / name
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def _job(folder, body, name="job.toml"):
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_job_file_parses_with_defaults_and_writes_itself_back(small):
    job = jobfile.load(_job(small, small_job()))
    assert job.name == "pets" and job.data.train == (small / "train.csv",) and job.data.test is None
    assert (job.train.learners, job.train.mode, job.train.batch, job.train.lr) == (2, "async", None, 0.01)
    assert job.transport.row_sparse is None  # "auto"
    assert job.output == small / "runs" / "pets"
    train, validation, test = data.load_job(job)
    assert train.label_names == ["cat", "dog"] and len(test) == 4  # 10% of each label held out
    assert len(validation) == 4 and len(train) == 32  # and 10% of each label of the rest, for validation
    assert validation.label_names == train.label_names and sorted(validation.labels) == [0, 0, 1, 1]
    filled, chosen = job.with_defaults(len(train))
    assert filled.train.batch == 2 and "batch = 2" in chosen[0]
    assert filled.train.optimizer == "adagrad" and "optimizer = adagrad" in chosen[1]
    assert filled.train.epochs == 40 and "epochs = 40" in chosen[2]
    again = jobfile.load(_job(small, filled.to_toml(), "as-run.toml"))
    assert again == jobfile.Job(**{**filled.__dict__, "path": again.path})
    assert 'row_sparse = "auto"' in filled.to_toml()  # the job as run says what it left to the server


@pytest.mark.parametrize("samples, batch, epochs", [
    (36, 2, 40), (5_452, 2, 40), (6_920, 2, 35), (10_003, 4, 40), (40_000, 4, 12), (100_000, 4, 5),
    (200_000, 32, 20), (1_000_000, 32, 4), (3_000_000, 32, 3)])
def test_the_default_epoch_cap_makes_a_fixed_number_of_updates_between_3_and_40(samples, batch, epochs):
    assert jobfile.default_epochs(samples, batch) == epochs


@pytest.mark.parametrize("samples, batch", [(9_999, 2), (10_000, 4), (100_000, 4), (100_001, 32)])
def test_the_default_mini_batch_follows_the_data_set_size(samples, batch):
    assert jobfile.default_batch(samples) == batch


@pytest.mark.parametrize("edit, message", [
    (("[train]\nlerners = 2\n", None), "[train] unknown key 'lerners' (did you mean 'learners'?); allowed: learners"),
    (("[trian]\n", None), "unknown section [trian] (did you mean 'train'?)"),
    (("[train]\nworkload = \"ngram\"\n", None), "[train] unknown key 'workload' (it belongs in [job]); allowed: "),
    (("[checkpoint]\nlerners = 2\n", None), "[checkpoint] unknown key 'lerners'; allowed: interval"),
    (("[train]\nlearners = \"2\"\n", None), "[train] learners = '2' is a string; allowed: an integer"),
    (("[train]\nlearners = 0\n", None), "[train] learners = 0 is out of range; allowed: 1 to 64"),
    (("[train]\nlr = -0.1\n", None), "[train] lr = -0.1 is out of range; allowed: a number above 0"),
    (("[train]\nepochs = 1.5\n", None), "[train] epochs = 1.5 is a number; allowed: an integer"),
    (("[train]\nmode = \"hogwild\"\n", None),
     "[train] mode = 'hogwild' is not one of the choices; allowed: async, consistent"),
    (("[train]\noptimizer = \"rmsprop\"\n", None),
     "[train] optimizer = 'rmsprop' is not one of the choices; allowed: sgd, adagrad, adam"),
    (("[train]\nnonfinite = \"drop\"\n", None),
     "[train] nonfinite = 'drop' is not one of the choices; allowed: skip, stop"),
    (("[transport]\nrow_sparse = \"yes\"\n", None),
     "[transport] row_sparse = 'yes' is a string; allowed: true, false or \"auto\""),
    (("[train]\noptimizer = \"adagrad\"\nmode = \"elastic\"\n", None),
     "[train] optimizer = 'adagrad' with mode = 'elastic': elastic learners take their own local steps"),
    (("[train]\noptimizer = \"adam\"\nmode = \"elastic\"\n", None),
     "[train] optimizer = 'adam' with mode = 'elastic': elastic learners take their own local steps"),
    (("[train]\noptimizer = \"adam\"\nmomentum = 0.9\n", None),
     "[train]: momentum applies to the sgd optimizer, not adam"),
    (("[data2]\n", None), "unknown section [data2] (did you mean 'data'?)"),
    ((None, ("train = \"train.csv\"", "train = \"missing.csv\"")), "[data] train = '"),
    ((None, ("format = \"csv\"", "format = \"xml\"")), "[data] format = 'xml': not a format; allowed: csv, tsv"),
    ((None, ("workload = \"textcnn\"", "workload = \"textcnm\"")), "unknown workload (did you mean 'textcnn'?)"),
    ((None, ("name = \"pets\"", "name = \"my job\"")), "[job] name = 'my job': job name 'my job' is not allowed"),
    ((None, ("[job]\n", "[job]\nowner = 1\n")), "[job] unknown key 'owner'"),
    ((None, ("name = \"pets\"\n", "")), "[job] name is missing; it is required"),
    ((None, ("[data]", "[data]\nholdout = 0.7")), "[data] holdout = 0.7 is out of range"),
    ((None, ("train = \"train.csv\"", "train = [\"train.csv\", \"train.csv\"]")), "format 'csv' reads one file"),
    ((None, ("[job]", "[job\n")), "not valid TOML"),
    ((None, ("[data]", "[data]\nheader = false")), "[data] label_column = 'category' names a column, but header = "
                                                 "false; allowed: its number (1 is the first column)"),
    ((None, ("format = \"csv\"", "format = \"trec\"\nheader = false")),
     "[data] header = false: only csv and tsv files have a header row, not format 'trec'"),
    ((None, ("label_column = \"category\"", "label_column = 0")), "[data] label_column = 0 is out of range; allowed: "
                                                                 "a column name, or a number from 1"),
    ((None, ("label_column = \"category\"", "label_column = 1.5")), "[data] label_column = 1.5 is a number; allowed: "
                                                                   "a column name (string) or a column number"),
    ((None, ("format = \"csv\"\nlabel_column = \"category\"", "format = \"jsonl\"\nlabel_column = 2")),
     "[data] label_column = 2: jsonl names keys; allowed: a key (string)"),
    (("[train]\nthreads = 0\n", None),
     '[train] threads = 0 is out of range; allowed: an integer from 1 to 1,024, or "auto" (the cores less one'),
    (("[train]\nthreads = \"many\"\n", None),
     '[train] threads = \'many\' is a string; allowed: an integer from 1 to 1,024, or "auto"'),
    (("[train]\nthreads = 2.5\n", None), "[train] threads = 2.5 is a number; allowed: an integer from 1 to 1,024"),
])
def test_a_bad_job_file_is_refused_naming_field_value_and_what_is_allowed(small, edit, message):
    append, swap = edit
    body = textwrap.dedent(small_job())
    if swap:
        assert swap[0] in body
        body = body.replace(swap[0], swap[1], 1)
    if append:
        body += append
    with pytest.raises(JobFileError) as err:
        jobfile.load(_job(small, body))
    assert message in str(err.value) and "job.toml" in str(err.value)


def test_a_validation_file_is_read_and_a_label_it_alone_has_is_named(small):
    """[data] validation names the file the model is chosen on (nothing of train is held out
    for it then); a share of train otherwise ([data] validation_holdout); [train] patience."""
    _csv(small, ["a dog barks,dog", "a cat purrs,cat", "the cat sleeps,cat"], name="dev.csv")
    job = jobfile.load(_job(small, small_job() + 'validation = "dev.csv"\n[train]\npatience = 5\n'))
    assert job.data.validation == (small / "dev.csv",) and job.train.patience == 5
    train, validation, test = data.load_job(job)
    assert len(validation) == 3 and len(train) == 36 and len(test) == 4
    job = jobfile.load(_job(small, small_job() + "validation_holdout = 0.3\n"))
    train, validation, test = data.load_job(job)
    assert len(validation) == 10 and len(train) == 26  # 30% of each label (18) of the 36 left after the test share
    _csv(small, ["a bird sings,bird"], name="dev.csv")
    job = jobfile.load(_job(small, small_job() + 'validation = "dev.csv"\n'))
    with pytest.raises(JobFileError,
                       match=r"\[data\] validation: .*dev.csv: label 'bird' does not occur in the training set"):
        data.load_job(job)
    with pytest.raises(JobFileError, match=r"\[train\] patience"):
        jobfile.load(_job(small, small_job() + "[train]\npatience = 0\n"))


def test_long_texts_are_cut_to_max_words_and_the_rings_carry_a_batch_of_the_longest(small):
    """A text longer than [data] max_words (1,000 by default) is cut to its first words as it is
    read, counted in its file's report; where a mini-batch of the longest texts touches more
    rows of the n-gram table than a gradient carries by default (8,192), the job's max_rows is
    chosen for it (the rings are made so), and said; one that fits keeps "auto", and so does a
    job of dense gradients (row_sparse = false, a bridged node's)."""
    from gadei.prepare import _rows

    texts = [" ".join(f"w{i}x{j}" for j in range(1_500 if i % 4 == 0 else 20)) for i in range(40)]
    _csv(small, [f"{text},{('cat', 'dog')[i % 2]}" for i, text in enumerate(texts)])
    body = small_job().replace('"textcnn"', '"ngram"')
    for words, batch, rows in ((None, 8, 8 * 2_001 + 1), (1_200, 8, 8 * 2_401 + 1), (None, 2, None)):
        job = jobfile.load(_job(small, body + (f"max_words = {words}\n" if words else "") +
                                f"[train]\nbatch = {batch}\n"))
        reports = []
        train, _, _ = data.load_job(job, reports)
        cut = words or 1_000
        assert max(map(len, train.ids)) == 2 * cut + 1  # its uni- and bigrams, its ends marked
        assert f"cut to their first {cut:,} words ([data] max_words): 10 samples (lines 2, 6, 10, 14, 18, ...; " \
               "the longest 1,500 words)" in str(reports[0])
        filled, chosen = job.with_defaults(len(train), _rows(train))
        assert filled.transport.max_rows == rows
        assert any(line.startswith(f"max_rows = {rows or 0:,} (auto") for line in chosen) == (rows is not None)
        assert jobfile.load(_job(small, filled.to_toml(), "as-run.toml")).transport.max_rows == rows
    given = jobfile.load(_job(small, body + "[train]\nbatch = 8\n[transport]\nmax_rows = 100\n"))
    assert given.with_defaults(36, _rows(data.load_job(given)[0]))[0].transport.max_rows == 100  # the file's
    for dense in (jobfile.load(_job(small, body + "[train]\nbatch = 8\n[transport]\nrow_sparse = false\n")),
                  jobfile.load(_job(small, body + "[train]\nbatch = 8\n")).for_node(0, 2)):  # a bridged node's
        filled, chosen = dense.with_defaults(36, _rows(data.load_job(dense)[0]))
        assert filled.transport.max_rows is None and not [line for line in chosen if "max_rows" in line]
    for bad in ("0", "1_000_001", "1.5", '"many"', "true"):
        with pytest.raises(JobFileError, match=r"job.toml: \[data\] max_words = .* allowed: an integer from 1 to "
                                               r"1,000,000"):
            jobfile.load(_job(small, small_job() + f"max_words = {bad}\n"))


def test_a_job_prepared_with_its_sets_encoded_is_read_from_them_while_its_files_are_unchanged(small, caplog):
    """A daemon's job is prepared with its data sets as encoded (its supervisor, forked by the
    zygote, is not forked with them): they read back as the files read, while the job.toml and
    the data files are unchanged; a changed file, or an encoded file that does not hold together,
    is not used (the files are read), with a warning for the latter."""
    import numpy as np

    from gadei.prepare import prepare

    job = jobfile.load(_job(small, small_job() + '[output]\nfolder = "out"\n'))
    prepared = prepare(job, False, encoded=True)
    encoded, as_run = small / "out" / data.ENCODED, jobfile.load(small / "out" / "job.toml")
    found = data.read_encoded(as_run)
    assert found is not None
    for got, made in zip(found, (prepared.train, prepared.validation, prepared.test)):
        assert (got.ids, got.labels, got.label_names, got.vocab, got.name) == \
            (made.ids, made.labels, made.label_names, made.vocab, made.name)
    assert data.load(get_workload("textcnn"), f"job:{as_run.path}")[0].ids == prepared.train.ids

    train = small / "train.csv"
    then = train.stat().st_mtime_ns
    os.utime(train, ns=(then, then + 10**9))  # the data changed since
    assert data.read_encoded(as_run) is None
    os.utime(train, ns=(then, then))
    assert data.read_encoded(as_run) is not None
    train.rename(small / "gone.csv")  # gone since the job.toml was read: the read of the files says so, alone
    caplog.clear()
    assert data.read_encoded(as_run) is None and "not read" not in caplog.text
    (small / "gone.csv").rename(train)

    arrays = dict(np.load(encoded))
    arrays["train_ids"] = arrays["train_ids"].copy()
    arrays["train_ids"][0] = len(prepared.train.vocab)  # an id beyond the vocabulary
    made = encoded.read_bytes()
    for damaged in (made[: len(made) // 2], b"not a zip file", lambda f: np.savez(f, **arrays)):
        if callable(damaged):
            with open(encoded, "wb") as f:
                damaged(f)
        else:
            encoded.write_bytes(damaged)
        caplog.clear()
        assert data.read_encoded(as_run) is None
        assert "reading the job's data files instead" in caplog.text
    assert data.load(get_workload("textcnn"), f"job:{as_run.path}")[0].ids == prepared.train.ids

    prepared.claim.close()  # that run ended: its folder is free for the next
    prepare(job, False).claim.close()  # as `gadei run` prepares it: its supervisor is forked with the sets
    assert not encoded.exists()
    encoded.mkdir()  # cannot be written (as a full disk): said, and the job goes on to read its files
    caplog.clear()
    data.save_encoded(prepared.job, (prepared.train, prepared.validation, prepared.test))
    assert "not written" in caplog.text and "reads its data files" in caplog.text
    assert data.read_encoded(as_run) is None


def test_a_check_given_the_job_as_checked_before_takes_its_sets_and_reads_nothing(small):
    """The daemon's start of a job whose files are unchanged since its submit checks it again
    with the sets its submit read (each candidate's, for a job that picks its model)."""
    from gadei.prepare import check

    for workload in ("textcnn", "auto"):
        job = jobfile.load(_job(small, small_job().replace('"textcnn"', f'"{workload}"')))
        first = check(job, False)
        again = check(job, False, checked=first)
        made = [(p.job.workload, p.train, p.validation, p.test) for p in first.candidates or [first]]
        taken = [(p.job.workload, p.train, p.validation, p.test) for p in again.candidates or [again]]
        assert len(made) == len(taken) == (2 if workload == "auto" else 1)
        assert all(a is b for m, t in zip(made, taken) for a, b in zip(m[1:], t[1:])) and made[0][0] == taken[0][0]
        assert again.read == first.read and again.chosen == first.chosen


def test_a_job_refused_for_its_output_folder_is_refused_before_its_data_is_read(small):
    """What the output folder holds is judged before the data is read (minutes for a large set):
    a folder that holds a run, or a resume of a folder that holds none, is refused for that even
    where the data would be refused too (train.csv has no column `category` here)."""
    from gadei.prepare import check

    (small / "train.csv").write_text("text,label\nhello there,a\n")
    job = jobfile.load(_job(small, small_job() + '[output]\nfolder = "out"\n'))
    with pytest.raises(GadeiError, match="category"):  # the data is refused where the folder is not
        check(job, resume=False)
    with pytest.raises(GadeiError, match=r"--resume: .*out holds no run to go on with"):
        check(job, resume=True)
    (small / "out" / "checkpoints").mkdir(parents=True)
    (small / "out" / "checkpoints" / "000001.pt").write_bytes(b"")
    with pytest.raises(GadeiError, match="out holds a previous run"):
        check(job, resume=False)
    (small / "out" / "job.toml").write_text(job.to_toml())
    with pytest.raises(GadeiError, match="--resume: no checkpoint in .* that verifies"):
        check(job, resume=True)


def test_a_job_that_runs_now_is_refused_a_second_run_and_a_resume(small):
    """A job runs once at a time: while its server serves it, `gadei run` (and a submit) of it,
    afresh or `--resume`, is refused before it writes a file (a resume of a running job once
    started a second supervisor on its folder, and both wrote its outputs)."""
    import gadei
    from gadei.prepare import check

    name = unique_name("twice")
    job = jobfile.load(_job(small, small_job(name) + '[output]\nfolder = "out"\n'))
    with gadei.Server(name, n_params=10):
        for resume in (False, True):
            with pytest.raises(GadeiError, match=f"job '{name}' runs now \\(its server is pid {os.getpid()}\\), and a "
                                                 "job runs once at a time"):
                check(job, resume=resume)
    assert not (small / "out").exists()
    assert check(job, resume=False).job.name == name  # once it ended


def test_a_run_whose_job_toml_gave_max_rows_8192_resumes_under_auto(small):
    """A run of a gadei before max_rows "auto" wrote the rows it took (8,192) in its job.toml: a
    resume of the same job, whose max_rows is now "auto" and fits them, compares equal; other rows
    are a change a resume refuses (the rings' format)."""
    from gadei.prepare import resume_point

    job = jobfile.load(_job(small, small_job()))
    job = job.with_defaults(36)[0]
    assert job.transport.max_rows is None
    (job.output).mkdir(parents=True)
    for rows, said in ((8192, "no checkpoint in"), (100, "differs from the run in")):
        (job.output / "job.toml").write_text(job.to_toml().replace('max_rows = "auto"', f"max_rows = {rows}"))
        with pytest.raises(GadeiError, match=said):
            resume_point(job)


def test_validation_holdout_0_holds_nothing_out_and_a_bridged_node_holds_nothing_out(small):
    """validation_holdout = 0: no validation set (all of train is trained on, to the cap); a
    bridged node's job (Job.for_node) holds none out either: its model is the one the nodes'
    bridge agrees on, so a validation share would be training data lost for nothing."""
    job = jobfile.load(_job(small, small_job() + "validation_holdout = 0\n"))
    train, validation, test = data.load_job(job)
    assert validation is None and len(train) == 36 and len(test) == 4
    again = jobfile.load(_job(small, job.to_toml()))  # the job as run (job.toml) reads back
    assert again.data.validation_holdout == 0.0
    for bad in ("0.5", "-0.1"):
        with pytest.raises(JobFileError,
                           match=r"validation_holdout = .* allowed: 0 \(no validation set\) or more than 0"):
            jobfile.load(_job(small, small_job() + f"validation_holdout = {bad}\n"))
    node = jobfile.load(_job(small, small_job())).for_node(1, 2)
    train, validation, test = data.load_job(node)
    assert node.data.validation_holdout == 0.0 and validation is None and len(train) == 36
    _csv(small, ["a dog barks,dog", "a cat purrs,cat"], name="dev.csv")
    node = jobfile.load(_job(small, small_job() + 'validation = "dev.csv"\n')).for_node(0, 2)
    train, validation, test = data.load_job(node)
    assert len(validation) == 2 and len(train) == 36  # a validation file is the user's: kept (reported, unused)


@pytest.mark.parametrize("rows, header, message", [
    ([], "text,category", "no samples"),
    (["hello,cat"], "text,label",
     "[data] label_column = 'category' is not a column of its header (columns: 'text', 'label')"),
    ([f"sentence {i},cat" for i in range(5)], "text,category", "only the label 'cat'; a classifier needs at least two"),
    # the columns' names swapped: each text a label, nothing held out (it trained a model of 6 classes, 1 a sample)
    ([f"sentence {i},{'cat' if i % 2 else 'dog'}" for i in range(6)], "category,text",
     "[data] train: 6 labels for 6 samples (6 of them seen once, e.g. 'sentence 0'): a classifier learns labels that "
     "recur, and nothing can be held out to validate or test one seen once; does [data] label_column = 'category' "
     "hold the classes, not values or texts?"),
    (["hello,"], "text,category",
     "no samples (train.csv: 2 lines, 0 samples; left out: 1 row with a blank label (line 2))"),
    ([], "text,category", "no samples (train.csv: 1 line, 0 samples)"),  # its header alone
])
def test_bad_data_is_refused_before_anything_starts(small, rows, header, message):
    _csv(small, rows, header=header)
    job = jobfile.load(_job(small, small_job()))
    with pytest.raises(JobFileError) as err:
        data.load_job(job)
    assert message in str(err.value)


def test_gadei_run_check_reads_a_job_file_saved_with_a_byte_order_mark_and_refuses_the_label_as_the_text(small,
                                                                                                          procs):
    """What a newcomer's first job files hold: one saved by a Windows editor starts with a UTF-8
    byte-order mark, which is read as data files' is (it was `not valid TOML: Invalid
    statement (at line 1, column 1)`); one whose text_column names the label column, by name
    or by number, is refused naming both (it trained on the label as the text: vocabulary 4)."""
    marked = small / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + small_job().encode())
    same = _job(small, small_job() + 'text_column = "category"\n', "same.toml")
    by_number = _job(small, small_job() + "text_column = 2\n", "by_number.toml")
    runs = {path: procs.gadei("run", "--check", path) for path in (marked, same, by_number)}
    out, err = communicate(runs[marked], 120)
    assert runs[marked].returncode == 0 and out.splitlines()[-1] == "check passed", out + err
    for path in (same, by_number):
        out, err = communicate(runs[path], 120)
        assert runs[path].returncode == 2 and "Traceback" not in err, err
        assert (f"[data] text_column = {'2' if path == by_number else repr('category')} and label_column = "
                "'category' both name column 2 ('category'): the label would be the text") in err, err


def test_utf16_files_are_named_as_such_and_read_when_the_job_says_so(small):
    """What Windows tools save as "Unicode": a job file in UTF-16 is refused saying so (it was
    `not UTF-8 text (byte 0)`), and a data file in UTF-16 too, naming the encoding to set (it was
    "binary, not text: a NUL byte on line 1"), which then reads it to the same samples."""
    marked = small / "wide.toml"
    marked.write_bytes(small_job().encode("utf-16"))
    with pytest.raises(JobFileError, match=r"wide.toml': not UTF-8 text \(line 1, byte 0: invalid start byte\); it is "
                                           r"UTF-16 \(it starts with a UTF-16 byte-order mark\), and a TOML file is "
                                           r"UTF-8: save it as UTF-8$"):
        jobfile.load(marked)
    latin = small / "latin.toml"  # one byte of Latin-1 in a comment: the line and byte that are not UTF-8
    latin.write_bytes(small_job().replace("\n", "\n# caf\xe9\n", 1).encode("latin-1"))
    with pytest.raises(JobFileError, match=r"latin.toml': not UTF-8 text \(line 2, byte [0-9]+: invalid continuation "
                                           r"byte\)$"):
        jobfile.load(latin)
    expected = data.load_job(jobfile.load(_job(small, small_job())))
    train = small / "train.csv"
    train.write_bytes(train.read_text(encoding="utf-8").encode("utf-16"))
    with pytest.raises(JobFileError, match=r"train.csv' is UTF-16 text \(it starts with a UTF-16 byte-order mark\), "
                                           r"not utf-8: set \[data\] encoding = \"utf-16\""):
        data.load_job(jobfile.load(_job(small, small_job())))
    wide = data.load_job(jobfile.load(_job(small, small_job() + 'encoding = "utf-16"\n')))
    assert [(s.ids, s.labels, s.label_names) for s in wide] == [(s.ids, s.labels, s.label_names) for s in expected]


def test_a_file_that_does_not_decode_names_its_byte_and_the_fallback_reads_it(small):
    (small / "train.csv").write_bytes(b"text,category\ncaf\xe9 au lait,drink\ntea,drink\nbread,food\nrice,food\n")
    job = jobfile.load(_job(small, small_job()))
    with pytest.raises(JobFileError,
                       match=r"is not utf-8 \(line 2, byte 17: invalid continuation byte\); set \[data\] encoding"):
        data.load_job(job)
    job = jobfile.load(_job(small, small_job() + 'fallback_encoding = "latin-1"\n'))
    train, validation, test = data.load_job(job)
    assert len(train) + len(validation) + len(test) == 4
    from gadei_workloads.files import read

    rows = read(list(job.data.train), "csv", label_column="category", fallback="latin-1")
    assert rows[0] == (["cafe", "au", "lait"], "drink")  # decoded as Latin-1 (the tokenizer folds accents)


def _format_job(folder, fmt, train, extra=""):
    return jobfile.load(_job(folder, f"""
        [job]
        name = "f"
        workload = "textcnn"
        [data]
        train = {json.dumps(train)}
        {f'format = "{fmt}"' if fmt else ""}
        {extra}
    """))


def test_a_headerless_file_takes_columns_by_number_and_writes_them_back(tmp_path):
    (tmp_path / "train.tsv").write_text("".join(f"{'dog' if i % 2 else 'cat'}\tsentence {i}\n" for i in range(20)))
    job = _format_job(tmp_path, "tsv", "train.tsv", "header = false")
    assert (job.data.header, job.data.label_column, job.data.text_column) == (False, 1, 2)
    reports = []
    train, validation, test = data.load_job(job, reports)
    assert len(train) + len(validation) + len(test) == 20 and str(reports[0]) == "train.tsv: 20 lines, 20 samples"
    assert jobfile.parse(tomllib.loads(job.to_toml()), job.path) == job  # job.toml as run reads back the same


def test_every_data_format_reads_the_same_samples(tmp_path):
    samples = [("the cat sat", "cat"), ("a dog ran, far", "dog"), ("cats purr\tsoftly", "cat"), ("dogs bark", "dog")]
    (tmp_path / "a.csv").write_text("label,text\n" + "".join(f'{label},"{text}"\n' for text, label in samples))
    (tmp_path / "a.tsv").write_text("text\tlabel\n" + "".join(f"{text.replace(chr(9), ' ')}\t{label}\n"
                                                              for text, label in samples))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": text, "label": label}) + "\n"
                                              for text, label in samples))
    (tmp_path / "a.txt").write_text("".join(f"{label} {text}\n" for text, label in samples))
    (tmp_path / "a.trec").write_text("".join(f"{label}:x {text}\n" for text, label in samples))
    folder = tmp_path / "per-label"
    folder.mkdir()
    for name in ("cat", "dog"):
        (folder / f"{name}.txt").write_text("".join(f"{text}\n" for text, label in samples if label == name))
    jobs = [_format_job(tmp_path, "csv", "a.csv"), _format_job(tmp_path, "tsv", "a.tsv"),
            _format_job(tmp_path, "jsonl", "a.jsonl"), _format_job(tmp_path, "label-text", "a.txt"),
            _format_job(tmp_path, "trec", "a.trec"), _format_job(tmp_path, "per-label", "per-label"),
            _format_job(tmp_path, "per-label", ["per-label/cat.txt", "per-label/dog.txt"])]
    read = []
    for job in jobs:
        from gadei_workloads.files import read as read_rows

        rows = read_rows(list(job.data.train), job.data.format)
        read.append(sorted((" ".join(toks), label) for toks, label in rows))
    assert all(r == read[0] for r in read), read
    assert len(read[0]) == 4

    (tmp_path / "A.JSONL").write_bytes((tmp_path / "a.jsonl").read_bytes())
    for train, fmt in [("a.csv", "csv"), ("a.tsv", "tsv"), ("A.JSONL", "jsonl"), ("per-label", "per-label"),
                       (["per-label/cat.txt", "per-label/dog.txt"], "per-label")]:  # a job file that gives no format
        job = _format_job(tmp_path, None, train)
        assert job.data.format == fmt and 'format = "' + fmt in job.to_toml()  # the job as run says it
    for train in ("a.txt", "a.trec"):
        with pytest.raises(JobFileError, match=rf"\[data\] format is missing, and '{train}' does not say it \(a .csv, "
                                               r".tsv, .jsonl or .npz file, or a per-label folder\); allowed: csv, "):
            _format_job(tmp_path, None, train)


def test_a_per_label_file_names_its_label():
    from pathlib import Path

    from gadei_workloads.files import label_of_file

    assert [label_of_file(Path(n)) for n in ("positive.txt", "custrev.pos", "subj.objective", "neg")] == \
        ["positive", "pos", "objective", "neg"]


def test_gadei_run_trains_a_job_file_and_leaves_its_outputs(tmp_path, procs):
    name = unique_name("run")
    path = _job(tmp_path, trec_job(name, train={"learners": 2, "epochs": 2, "lr": 0.05}, checkpoint={"interval": 5}))
    run = procs.gadei("run", path)
    out, err = communicate(run, 600)
    assert run.returncode == 0, out + err
    assert "4,906 training / 546 validation / 500 test samples" in out  # 10% of each label held out for validation
    assert "chose batch = 2 (default for 4,906 training samples" in out and "done in" in out
    folder = tmp_path / "out"
    for name_ in ("job.toml", "labels.json", "vocab.json", "model.pt", "metrics.jsonl", "accuracy.png"):
        assert (folder / name_).exists(), name_
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2] and metrics[-1]["test_accuracy"] > 0.8
    # one numbering: launched learner k is learner k in its log (and its records), whoever attached first
    for k in (0, 1):
        log = (folder / "logs" / f"learner-{k}.log").read_text()
        assert f"learner {k} attached" in log and f'"learner": {1 - k}' not in log, log[-2000:]
    state = torch.load(folder / "model.pt", weights_only=True)
    assert json.loads((folder / "labels.json").read_text()) == ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
    assert state["out.weight"].shape[0] == 6
    vocab = json.loads((folder / "vocab.json").read_text())["tokens"]
    assert state["embedding.weight"].shape[0] == len(vocab)
    assert inspect(name) is None
    predicted = procs.gadei("predict", folder, "How far is it from Denver to Aspen ?")
    out, _ = communicate(predicted, 60)
    assert predicted.returncode == 0 and out.splitlines()[0].split()[-1] == "NUM", out
    again = procs.gadei("run", path)  # the folder holds a run: refused, nothing started
    _, err = communicate(again, 60)
    assert again.returncode == 2 and "holds a previous run" in err


def test_gadei_run_says_the_learners_threads_and_its_learners_run_them(small, procs):
    """[train] threads reaches every learner `gadei run` starts (through the job as run,
    job.toml): each learner's log says the PyTorch threads it trains with, and the run's opening
    lines say what was chosen (3 a learner here, over-subscribing a small machine on purpose).

    The server's OpenMP threads sleep between updates (`gadei serve` loads its runtime passive).
    The learners' keep OpenMP's default wait where their threads and the server fit the cores
    (passive, PyTorch's step at a small mini-batch took nearly twice as long with 2 threads as
    with one), and sleep too where they do not, as here on fewer than 7 cores (spinning, 2
    learners of 2 threads on 2 cores took an epoch 7x as long)."""
    name = unique_name("threads")
    path = _job(small, small_job(name) + '[train]\nlearners = 2\nepochs = 1\nthreads = 3\n[output]\nfolder = "out"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = procs.gadei("run", path, "--quiet", env=env)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert "  learners: 2 x 3 PyTorch threads ([train] threads" in out, out
    assert "threads = 3\n" in (small / "out" / "job.toml").read_text()
    logs = small / "out" / "logs"
    over = 2 * 3 + 1 > len(os.sched_getaffinity(0))
    # passive: the job's (a process started anew), or gadei's own (forked warm from the supervisor, `gadei.zygote`)
    passive = ("OpenMP wait policy: OMP_WAIT_POLICY=PASSIVE", "OpenMP wait policy: passive (gadei's")
    assert any(p in (logs / "server.log").read_text() for p in passive)
    assert ("their idle threads sleep (OMP_WAIT_POLICY=PASSIVE)" in out) is over, out
    for i in range(2):
        log = (logs / f"learner-{i}.log").read_text()
        # torch.get_num_threads() in the learner, once it attached; OpenMP's default: started anew, not forked
        said = [f"3 PyTorch threads, {p}" for p in passive] if over else \
            ["3 PyTorch threads, OpenMP wait policy: OpenMP's default, pull"]
        assert any(line in log for line in said), log


@pytest.mark.long  # two TREC runs: most of a minute
def test_a_stopped_run_goes_on_with_resume_and_trains_each_mini_batch_once(tmp_path, procs):
    name = unique_name("resume")

    def body(epochs: int, lr: float) -> str:
        return trec_job(name, train={"learners": 2, "epochs": epochs, "lr": lr}, checkpoint={"interval": 600})

    path = _job(tmp_path, body(epochs=1, lr=0.05))
    run = procs.gadei("run", path, "--quiet")

    wait_for(lambda: job_version(name) >= 300, 120, "the job to make 300 updates")
    # SIGTERM (gadei cancel; Ctrl-C takes the same path, but a shell started in the background
    # hands its children SIGINT ignored): checkpoint with the learners' progress, then stop
    run.send_signal(signal.SIGTERM)
    out, err = communicate(run, 120)
    assert run.returncode == 130 and "stopped after" in out and "--resume" in out, out + err
    folder = tmp_path / "out"
    stopped = json.loads((folder / "result.json").read_text())
    assert not stopped["finished"]
    assert inspect(name) is None
    first = read_stop_record(folder / "logs" / "server-stop.json")

    changed = _job(tmp_path, body(epochs=2, lr=0.1))  # another lr: the schedules' maths differ
    refused = procs.gadei("run", changed, "--resume")
    _, err = communicate(refused, 60)
    assert refused.returncode == 2 and "[train] lr" in err and \
        "only [train] epochs, patience, devices and threads and the [checkpoint] settings may change" in err, err

    # the supervisor's log goes on across runs: what the runs before warned of, their own gadei run said
    with open(folder / "logs" / "supervisor.log", "a") as log_file:
        log_file.write("2026-11-29 00:00:00,000 gadei_watchdog.supervisor WARNING an earlier run's warning\n")
    longer = _job(tmp_path, body(epochs=2, lr=0.05))  # more epochs may be asked for
    resumed = procs.gadei("run", longer, "--resume", "--quiet")
    out, err = communicate(resumed, 600)
    assert resumed.returncode == 0 and "resuming from" in out and "done in" in out, out + err
    assert "an earlier run's warning" not in err, err
    last = read_stop_record(folder / "logs" / "server-stop.json")
    # every mini-batch of two epochs of each learner's shard is in the weights once: what the
    # first run applied before the progress checkpoint is not trained again, nothing is skipped
    steps = 2 * sum(-(-len(range(i, 4906, 2)) // 2) for i in range(2))  # TREC less its validation share
    assert last.version == steps, (first, last)
    assert 0 < last.resumed_applied <= first.version
    assert last.resumed_applied + last.applied == steps
    assert json.loads((folder / "result.json").read_text())["finished"]
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2] and all("staleness_mean" in m and "train_accuracy" in m
                                                           for m in metrics)


def _numeric_job(folder, train, fmt, extra=""):
    return jobfile.load(_job(folder, f"""
        [job]
        name = "blobs"
        workload = "mlp"
        [data]
        train = "{train}"
        format = "{fmt}"
        {extra}
    """))


def test_numeric_data_reads_the_same_from_npz_and_csv_and_bad_cells_are_named(tmp_path):
    import numpy as np

    x, y = blobs(40)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    header = ",".join([f"f{i}" for i in range(x.shape[1])] + ["label"])
    (tmp_path / "d.csv").write_text(header + "\n" + "".join(",".join(map(repr, row)) + f",{label}\n"
                                                         for row, label in zip(x.tolist(), y)))
    a = data.load_job(_numeric_job(tmp_path, "d.npz", "npz"))
    b = data.load_job(_numeric_job(tmp_path, "d.csv", "csv"))
    for da, db in zip(a, b):
        assert np.allclose(da.x, db.x) and (da.labels == db.labels).all() and da.label_names == db.label_names
    assert abs(float(a[0].x.mean())) < 0.2  # standardised with train's statistics
    (tmp_path / "bad.csv").write_text(header + "\n" + ",".join(["1"] * 3 + ["oops"] + ["1"] * 4) + ",a\n")
    with pytest.raises(JobFileError, match=r"bad.csv:2: column 'f3' holds 'oops', not a number"):
        data.load_job(_numeric_job(tmp_path, "bad.csv", "csv"))
    with pytest.raises(JobFileError, match=r"workload 'mlp' reads numeric feature vectors; allowed: csv, npz"):
        _numeric_job(tmp_path, "d.csv", "jsonl")
    np.savez(tmp_path / "wrong.npz", features=x)
    with pytest.raises(JobFileError, match=r"needs arrays 'x' .* and 'y'"):
        data.load_job(_numeric_job(tmp_path, "wrong.npz", "npz"))
    np.savez(tmp_path / "target.npz", x=x, y=x[:, 0])  # a regression target: each value a label of one sample
    with pytest.raises(JobFileError, match=r"train: 40 labels for 40 samples \(40 of them seen once, e.g. '.*'\): a "
                                           r"classifier learns labels that recur.*does its 'y' hold the classes"):
        data.load_job(_numeric_job(tmp_path, "target.npz", "npz"))
    np.savez(tmp_path / "complex.npz", x=x + 1j, y=y)  # a cast to float would drop the imaginary parts silently
    with pytest.raises(JobFileError, match=r"complex.npz: 'x' holds complex numbers \(complex128\); features and "):
        data.load_job(_numeric_job(tmp_path, "complex.npz", "npz"))
    np.savez(tmp_path / "flags.npz", x=x > x.mean(axis=0), y=y)  # yes/no features
    assert (data.load_job(_numeric_job(tmp_path, "flags.npz", "npz"))[0].x.std(axis=0) > 0).all()


@pytest.mark.long  # a second whole gadei run (TREC's is the default tier's)
def test_gadei_run_trains_the_mlp_on_numeric_data_and_predicts(tmp_path, procs):
    x, y = blobs(900)
    path = blobs_job(tmp_path, unique_name("mlp"), train={"learners": 2, "epochs": 4, "lr": 0.05})
    run = procs.gadei("run", path)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["test_accuracy"] > 0.9, metrics
    sample = ",".join(map(str, x[0]))
    predicted = procs.gadei("predict", tmp_path / "out", sample, "--top", 1)
    out, err = communicate(predicted, 60)
    assert predicted.returncode == 0 and out.split()[-1] == y[0], out + err
    from gadei.predict import predict

    features = tmp_path / "out" / "features.json"  # read from disk: one that is not as gadei run wrote it is refused
    written = json.loads(features.read_text())
    for damaged in ([1], {**written, "features": "5"}, {**written, "mean": written["mean"][:2]},
                    {**written, "mean": "x"}, {**written, "std": [0.0] * len(written["std"])}):
        features.write_text(json.dumps(damaged))
        with pytest.raises(GadeiError, match="features.json: not the count of the features and each one's mean"):
            predict(str(tmp_path / "out"), [sample])


def test_a_finished_run_is_said_to_have_finished_not_offered_resume(tmp_path, procs):
    """Running a finished job's file again (with or without --resume) says that its run finished
    (outcome done, when) and how to start afresh, not `--resume`, which has nothing to go on
    with (once it offered `gadei run --resume`, which then found no checkpoint to resume from)."""
    path = blobs_job(tmp_path, unique_name("again"), train={"learners": 2, "epochs": 1})
    run = procs.gadei("run", path, "--quiet")
    out, err = communicate(run, 300)
    assert run.returncode == 0 and json.loads((tmp_path / "out" / "result.json").read_text())["outcome"] == "done", \
        out + err
    for args in ([], ["--resume"]):
        again = procs.gadei("run", path, *args)
        _, err = communicate(again, 60)
        assert again.returncode == 2, err
        assert f"the run in {tmp_path / 'out'} finished (outcome done on " in err, err
        assert "set another [output] folder or remove that one" in err and "--resume`" not in err, err
        assert "no checkpoint" not in err, err


@pytest.mark.parametrize("first", ["metrics.jsonl", "logs/server-stop.json"])
def test_ctrl_c_while_the_outputs_of_a_finished_job_are_written_loses_nothing(tmp_path, procs, first):
    """Ctrl-C after the job ended, while its supervisor writes its outputs: the outputs are
    written all the same, and the run is one that finished (once a KeyboardInterrupt ended the
    writer mid-way, with no result.json and no one left to write it, and `--resume` then
    refused). SIGINT is sent again and again from `first` on until the run exits: the server's
    stop record (the job ended, its outputs not yet written) or metrics.jsonl, the first file
    `outputs.conclude` writes (a Ctrl-C in between once made the finished job one it had
    stopped)."""
    path = blobs_job(tmp_path, unique_name("late-c"), train={"learners": 2, "epochs": 2, "lr": 0.05})
    out = tmp_path / "out"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = procs.gadei("run", path, "--quiet")
    finally:
        signal.signal(signal.SIGINT, before)
    wait_for(lambda: (out / first).exists() or run.poll() is not None, 300, f"gadei run's job to leave {first}",
             interval=0.002)
    assert (out / "logs" / "server-stop.json").exists() and not (out / "result.json").exists()
    sent = 0
    while run.poll() is None:
        run.send_signal(signal.SIGINT)
        sent += 1
        try:
            run.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
    stdout, stderr = communicate(run, 60)
    assert sent > 0, "gadei run had exited before its outputs were written: " + stdout + stderr
    result = json.loads((out / "result.json").read_text())
    assert run.returncode == 0 and result["outcome"] == "done", (result, stdout + stderr)
    again = procs.gadei("run", path, "--resume")
    _, err = communicate(again, 60)
    assert again.returncode == 2 and f"the run in {out} finished (outcome done" in err, err


def test_a_run_whose_loss_becomes_nan_fails_naming_the_epoch_and_the_learning_rate(small, procs):
    name = unique_name("nan")
    path = _job(small, small_job(name) + '[train]\nlearners = 1\nlr = 10.0\noptimizer = "sgd"\nepochs = 3\n'
                '[output]\nfolder = "out"\n')
    run = procs.gadei("run", "--quiet", path)
    out, err = communicate(run, 300)
    assert run.returncode == 3, out + err
    assert "the training loss is nan after epoch 1" in err and "lr 10" in err and "lower [train] lr" in err, err
    assert "done in" not in out and inspect(name) is None


@pytest.mark.parametrize("cores, learners, threads", [(2, 1, 1), (2, 2, 1), (1, 4, 1), (4, 1, 3), (16, 2, 7),
                                                     (16, 4, 3), (16, 16, 1), (64, 3, 21)])
def test_auto_threads_fit_the_learners_and_the_server_on_the_cores(small, monkeypatch, cores, learners, threads):
    """[train] threads = "auto" (the default): the usable cores (this process's affinity, not
    the machine's count) less one for the server, shared by the learners, one each where that
    is all there is; the job as run (job.toml) and its learners (`gadei learn --job-file`) take
    the number chosen."""
    from gadei.cli import build_parser
    from gadei.cli.common import job_file_defaults

    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: set(range(cores)))
    job = jobfile.load(_job(small, small_job() + f"[train]\nlearners = {learners}\n"))
    assert job.train.threads is None and 'threads = "auto"' in job.to_toml()
    filled, _ = job.with_defaults(32)
    assert filled.train.threads == threads and filled.train.learners * threads + 1 <= max(cores, learners + 1)
    as_run = _job(small, filled.to_toml(), "as-run.toml")
    assert f"threads = {threads}\n" in as_run.read_text()
    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: set(range(cores * 2)))  # another machine:
    argv = ["learn", "pets", "--job-file", str(as_run)]  # a restarted learner takes what the run chose
    parser = build_parser()
    parser.verbs["learn"].set_defaults(**job_file_defaults(argv))
    assert parser.parse_args(argv).torch_threads == threads
    assert build_parser().parse_args(["learn", "pets"]).torch_threads == 1  # no job file: its own default


def test_threads_given_in_the_job_file_are_kept_whatever_the_cores(small, monkeypatch):
    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: {0, 1})
    job = jobfile.load(_job(small, small_job() + "[train]\nlearners = 2\nthreads = 3\n"))
    filled, _ = job.with_defaults(32)
    assert job.train.threads == filled.train.threads == 3 and "threads = 3\n" in filled.to_toml()
    from gadei.prepare import _threads_line

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert _threads_line(filled.train) == ("2 x 3 PyTorch threads ([train] threads; with the server more than the 2 "
                                           "cores; their idle threads sleep (OMP_WAIT_POLICY=PASSIVE))")
    auto = jobfile.load(_job(small, small_job() + '[train]\nlearners = 2\nthreads = "auto"\n')).train
    assert auto.threads is None and _threads_line(auto) == ("2 x 1 PyTorch thread (auto: 2 cores: one for the server, "
                                                            "and one thread a learner at least)")


@pytest.mark.parametrize("given, learners, threads, counted", [("4", 2, 1, 4), ("8", 2, 3, 8), ("64", 2, 7, 16)])
def test_gadei_cores_is_the_count_auto_threads_share(small, monkeypatch, given, learners, threads, counted):
    """GADEI_CORES (the daemon's share for a job beside others) caps the cores that threads =
    "auto" shares, never above the affinity, and the run's opening line says where the count
    comes from; the daemon's share of 16 cores for 4 jobs at once is 4 each, for one job nothing."""
    from gadei.env import job_cores_env
    from gadei.prepare import _threads_line

    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("GADEI_CORES", given)
    job = jobfile.load(_job(small, small_job() + f"[train]\nlearners = {learners}\n"))
    assert job.train.learner_threads == threads
    capped = " (GADEI_CORES; the process may use 16)" if counted < 16 else ""
    assert f"(auto: {counted} cores{capped}: one for the server" in _threads_line(job.train)
    assert job_cores_env(1) == {} and job_cores_env(2) == {"GADEI_CORES": str(counted // 2)}
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("GADEI_CORES", bad)
        with pytest.raises(ValueError, match=f"GADEI_CORES={bad!r}"):
            _ = job.train.learner_threads


@pytest.mark.parametrize("learners, threads, given, passive", [(2, 7, None, False), (2, 8, None, True),
                                                               (4, 1, None, False), (2, 8, "ACTIVE", False)])
def test_learners_threads_sleep_where_they_over_subscribe_the_cores(monkeypatch, learners, threads, given, passive):
    """On 16 cores, 2 learners of 7 threads and the server fit: OpenMP's default wait; 2 of 8
    do not: passive, unless the user set a policy; one thread a learner has no team to wait."""
    from gadei.env import learners_openmp_env

    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("GADEI_CORES", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    assert learners_openmp_env(learners, threads) == ({"OMP_WAIT_POLICY": "PASSIVE"} if passive else {})


def test_row_sparse_is_the_servers_choice_unless_the_job_file_says(small):
    """[transport] row_sparse: "auto" (the default) leaves the choice to the server (row-sparse
    where the model's embedding gradients are sparse), but a bridged node's gradients stay
    dense (the bridge moves every row); true and false reach the server as they are."""
    for value in ("true", "false", '"auto"'):
        job = jobfile.load(_job(small, small_job() + f"[transport]\nrow_sparse = {value}\n"))
        expected = {"true": True, "false": False}.get(value)
        assert job.transport.row_sparse is expected
        again = jobfile.load(_job(small, job.to_toml(), "as-run.toml"))
        assert again.transport.row_sparse is expected
        assert job.for_node(0, 2).transport.row_sparse is (expected if expected is not None else False)
    bridged = small_job() + "[transport]\nrow_sparse = true\n[bridge]\n"
    with pytest.raises(JobFileError, match=r"\[transport\] row_sparse = true with a \[bridge\] section"):
        jobfile.load(_job(small, bridged))
