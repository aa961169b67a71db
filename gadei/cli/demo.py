"""`gadei demo`: the text CNN with one server and two learners, end to end."""

import logging

from .. import options
from ..modes import RuleOptions
from .common import train_value

log = logging.getLogger("gadei.cli")


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(args)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train the text CNN with one server and two learners, end to end")
    p.add_argument("--data", default="generated", help="data set (default: generated, needs no files)")
    p.add_argument("--learners", type=train_value("learners"), default=2, help="learner processes (default 2)")
    p.add_argument("--epochs", type=train_value("epochs"), default=3, help="epochs over the training set (default 3)")
    p.add_argument("--batch", type=train_value("batch"), default=2, help="mini-batch size (default 2)")
    options.add_arguments(p, RuleOptions, skip=tuple(f.name for f in options.declared(RuleOptions) if f.name != "lr"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the trained weights here")
    p.set_defaults(func=cmd_demo)
