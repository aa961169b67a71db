"""`gadei bench quality`'s scikit-learn reference: what a user would train instead of the n-gram
workload, a linear SVM (`LinearSVC`) and a logistic regression (`LogisticRegression`) with
scikit-learn's default settings, on the same n-grams of the same split of a job file.

The features are the n-gram workload's own (`gadei_workloads.ngram.ngrams`: each distinct word
and bigram of a sentence, its ends marked, indexed from the training set), weighted as
scikit-learn's text pipelines weight them by default (`TfidfTransformer()`: smoothed idf, each
sample's vector of unit L2 norm), fitted on the job's training split; the validation split is
not used (neither model has anything to stop early). scikit-learn is the bench's extra, not the
service's: `pip install 'gadei[bench]'`.
"""

import logging
import time
import warnings

from ..errors import GadeiError

log = logging.getLogger(__name__)

MODELS = ("svc", "lr")  # sklearn-svc: LinearSVC(), sklearn-lr: LogisticRegression()
INSTALL = "pip install 'gadei[bench]'"


def check_installed() -> None:
    """Raise GadeiError saying what to install where scikit-learn is missing."""
    try:
        import sklearn  # noqa: F401
    except ImportError as err:
        raise GadeiError(f"gadei bench quality: the scikit-learn reference needs scikit-learn, which is not installed "
                         f"({err}); install it with {INSTALL}, or leave the reference out (--runs without sklearn)"
                         ) from None


def matrix(dataset):
    """The samples of a text dataset of n-gram ids as a sparse matrix of n-gram counts (rows:
    samples, columns: the vocabulary's ids; padding and the unknown n-gram, ids 0 and 1, left
    out, as the model leaves them out)."""
    import numpy as np
    from scipy import sparse

    rows = [[i for i in ids if i > 1] for ids in dataset.ids]
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(indptr[-1]))
    values = np.ones(len(indices), dtype=np.float64)
    return sparse.csr_matrix((values, indices, indptr), shape=(len(rows), len(dataset.vocab)))


def run_sklearn(path, model: str) -> dict:
    """The reference `model` ("svc" or "lr") on the job file `path`'s split, with the n-gram
    workload's features: test accuracy, seconds to fit and in all (the data's reading and
    encoding included, as a `gadei run`'s wall time includes them)."""
    if model not in MODELS:
        raise ValueError(f"reference model {model!r}: choose from {', '.join(MODELS)}")
    check_installed()
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import LinearSVC

    from .. import data, jobfile

    started = time.monotonic()
    job = jobfile.load(path)
    if job.workload != "ngram":
        raise ValueError(f"{path}: the reference takes the n-gram workload's features; the job names {job.workload!r}")
    train, _, test = data.load_job(job)
    weights = TfidfTransformer().fit(matrix(train))
    x_train, x_test = weights.transform(matrix(train)), weights.transform(matrix(test))
    classifier = LinearSVC() if model == "svc" else LogisticRegression()
    fitting = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        classifier.fit(x_train, train.labels)
    fitted = time.monotonic()
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    accuracy = float((classifier.predict(x_test) == test.labels).mean())
    return {"test_accuracy": accuracy, "features": x_train.shape[1], "converged": converged,
            "fit_seconds": round(fitted - fitting, 2), "wall_seconds": round(time.monotonic() - started, 1)}
