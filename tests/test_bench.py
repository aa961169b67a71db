"""The benches' records of the processes they run: a short run of gadei and of Hogwild through
`gadei.bench.peers.run_peer` (real processes, real shared memory) reports every process, its
role, CPU seconds and OS threads, so that a run on any machine shows what each one cost."""

import os

import pytest

from helpers import data_dir, missing


@pytest.mark.parametrize("kind, roles", [("gadei", ["server", "learner", "learner"]),
                                         ("hogwild", ["process", "process"])])
def test_a_run_records_every_process_with_its_cpu_and_threads(kind, roles):
    if not (data_dir() / "trec" / "TREC.train").is_file():
        missing("TREC is not in the shared data")
    from gadei.bench.peers import run_peer

    run = run_peer(kind, 2, 4, epochs=1, seed=0, lr=0.01, data=f"trec:{data_dir() / 'trec'}", limit=40,
                   timeout=120)
    processes = run["processes"]
    assert [p["role"] for p in processes] == roles  # one record per process, a server first
    assert [p["rank"] for p in processes if p["role"] != "server"] == [0, 1]
    assert len({p["pid"] for p in processes}) == len(roles) and os.getpid() not in {p["pid"] for p in processes}
    for p in processes:
        assert p["threads"] >= 1, p
        assert p["cpu_s"] > 0, p
    # the run's CPU is the sum of its processes' (the figure CPU ms/sample is made of)
    assert run["cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in processes))
    assert run["server_cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in processes if p["role"] == "server"))
