"""`gadei demo`: the text CNN with one server and two learners, end to end."""

import argparse
import logging

from .. import options
from ..modes import RuleOptions

log = logging.getLogger("gadei.cli")


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(args)


def _train_count(name: str):
    """An argparse type: an integer checked as a job file's [train] `name` is (its range,
    declared in `gadei.jobfile.Train`), so that `--batch 0` is refused before a process starts."""

    def parse(text: str) -> int:
        from ..jobfile import Train

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: "
                                             f"{options.allowed(Train, name)}") from None
        try:
            return options.check(Train, name, value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(options.said(text, err)) from None

    parse.__name__ = "int"
    return parse


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train the text CNN with one server and two learners, end to end")
    p.add_argument("--data", default="generated", help="data set (default: generated, needs no files)")
    p.add_argument("--learners", type=_train_count("learners"), default=2, help="learner processes (default 2)")
    p.add_argument("--epochs", type=_train_count("epochs"), default=3, help="epochs over the training set (default 3)")
    p.add_argument("--batch", type=_train_count("batch"), default=2, help="mini-batch size (default 2)")
    options.add_arguments(p, RuleOptions, skip=tuple(f.name for f in options.declared(RuleOptions) if f.name != "lr"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the trained weights here")
    p.set_defaults(func=cmd_demo)
