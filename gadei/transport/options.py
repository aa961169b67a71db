"""How a job's gradients travel through its rings: the options the server lays the region
out by (a job file's [transport], `gadei serve --help`)."""

from dataclasses import dataclass

from ..options import option

GRAD_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TransportOptions:
    """The rings' format, fixed when the server creates the region.

    Attributes:
        grad_dtype: element type of gradients in the rings; float16 and bfloat16 halve the
            bytes a step moves (the server applies them to float32 weights).
        row_sparse: embedding tables (nn.Embedding, nn.EmbeddingBag) travel as the rows a
            mini-batch touched instead of whole; needs the model (a workload or --model).
        max_rows: most distinct rows of one table one gradient may carry (row_sparse).
        slots: gradient slots per learner ring: a learner may have this many gradients
            published and not yet applied.
    """

    grad_dtype: str = option("float32", "gradients in the rings as float32, float16 or bfloat16", choices=GRAD_DTYPES)
    row_sparse: bool = option(False, "embedding tables travel as the rows a mini-batch touched (needs the model)")
    max_rows: int = option(8192, "row_sparse: most distinct rows of a table in one gradient", low=1, high=1 << 24)
    slots: int = option(2, "gradient slots per learner ring", low=1, high=64)
