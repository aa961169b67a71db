"""How a job's gradients travel through its rings: the options the server lays the region
out by (a job file's [transport], `gadei serve --help`)."""

from dataclasses import dataclass

from ..options import option

GRAD_DTYPES = ("float32", "float16", "bfloat16")
MAX_ROWS = 8192  # max_rows "auto": rows of a table one gradient may carry, unless the job's data needs more


@dataclass(frozen=True)
class TransportOptions:
    """The rings' format, fixed when the server creates the region.

    Attributes:
        grad_dtype: element type of gradients in the rings; float16 and bfloat16 halve the
            bytes a step moves (the server applies them to float32 weights).
        row_sparse: embedding tables (nn.Embedding, nn.EmbeddingBag) travel as the rows a
            mini-batch touched instead of whole; needs the model (a workload or --model). None
            ("auto"): the server turns it on where the model's embedding gradients are sparse,
            as the text CNN's are, except in elastic mode (which moves whole weights); so it
            reads and updates only the touched rows, not the whole table, every step.
        max_rows: most distinct rows of one table one gradient may carry (row_sparse). None
            ("auto"): MAX_ROWS, or more where a job file's training set has mini-batches that touch
            more (`gadei.jobfile.Job.with_defaults`: long texts, large batches).
        slots: gradient slots per learner ring: a learner may have this many gradients
            published and not yet applied. None ("auto"): `gadei.layout.ring_slots` chooses
            (8 where a ring of them fits 16 MiB, fewer for larger gradients, at least 2; 2 in
            sync mode), so that a server that naps between looks (`gadei.spin.nap_ns`) finds
            room left in every ring.
    """

    grad_dtype: str = option("float32", "gradients in the rings as float32, float16 or bfloat16", choices=GRAD_DTYPES)
    row_sparse: bool | None = option(None, "embedding tables travel as the rows a mini-batch touched (needs the "
                                     "model); auto: where the model's embedding gradients are sparse "
                                     "(nn.Embedding(sparse=True), as the text CNN's), except in elastic mode",
                                     auto=True)
    max_rows: int | None = option(None, "row_sparse: most distinct rows of a table in one gradient; auto: "
                                  f"{MAX_ROWS:,}, or the most a mini-batch of a job file's training set touches",
                                  low=1, high=1 << 24, auto=True, metavar="N|auto",
                                  allowed='1 to 16,777,216, or "auto"')
    slots: int | None = option(None, "gradient slots per learner ring; auto: 8 where a ring of them fits 16 MiB, "
                               "fewer for larger gradients (at least 2), 2 in sync mode", low=1, high=64, auto=True,
                               metavar="N|auto", allowed='1 to 64, or "auto"')

    @property
    def rows(self) -> int:
        """The most distinct rows of a table one gradient carries: `max_rows`, MAX_ROWS where
        it is "auto" and the job's data asked for no more (the server lays its slots out by it)."""
        return self.max_rows or MAX_ROWS
