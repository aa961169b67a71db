"""The supervisor of a job (installed as `gadei_watchdog`: the watchdog grown into the one owner
of a job): a process of its own that uses gadei, and that gadei starts but never imports
(`gadei.supervisor` is what gadei knows of it).

- `supervisor`: `Supervisor`, one job's server and learners started, watched,
  checkpointed and restarted, and the job's end decided;
- `learners`: the learners it launched, its children;
- `job`: a job file's supervisor (what `gadei run` and the daemon start): the commands made from
  the job, its epoch records followed, and its outputs written at its end;
- `cli`: `python -m gadei_watchdog`, which `gadei serve --checkpoint-dir` becomes.
"""

from gadei.env import quiet_openmp

quiet_openmp()  # before gadei's kernels load OpenMP: the supervisor forks the job's server (`gadei.zygote`)

from .supervisor import Supervisor  # noqa: E402

__all__ = ["Supervisor"]
