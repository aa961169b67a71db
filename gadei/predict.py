"""`gadei predict`: the top labels of a finished run's model, from its output folder alone
(job.toml, the maps and model.pt; its training data may be gone). A model file that is not
a plain state dict is refused with one line, never unpickled beyond weights. A job that picked
its model (`workload = "auto"`) predicts with the chosen candidate's (its run folder, which
result.json names: `gadei.outputs.model_folders`), or with the mean of the probabilities of the
candidates it chose to average (`gadei.ensemble`); each candidate's folder predicts as a run's."""

import json
import math
import pickle
import re
import warnings
from pathlib import Path

from . import ensemble, jobfile, outputs
from .errors import GadeiError


def predict(run_dir: str, texts: list[str], top: int = 3) -> list[list[tuple[str, float]]]:
    """For each of `texts` (a sentence; for a numeric workload, the features separated by
    commas), the `top` labels of the model in a `gadei run` output folder, with
    probabilities; the model is loaded once (plain PyTorch: the model file is a state dict).

    Raises:
        GadeiError: `texts` is one string (a list of its characters is never what was meant)
            or holds something else or a text with no words, `top` is less than 1, or the
            folder is not a finished run's.
    """
    if isinstance(texts, (str, bytes)):
        raise GadeiError(f"texts = {texts[:40]!r}: give a list of texts, not one string (its characters would be "
                         "the texts)")
    texts = list(texts)
    if not all(isinstance(text, str) for text in texts):
        odd = next(text for text in texts if not isinstance(text, str))
        raise GadeiError(f"texts: {odd!r} is {type(odd).__name__}; give texts as strings")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise GadeiError(f"top = {top!r}: the number of labels to give for each text, 1 or more")
    import torch

    folder = Path(run_dir)
    if not (folder / "job.toml").is_file():  # jobfile.load would say only that a job file is missing
        raise GadeiError(f"{run_dir} is not a `gadei run` output folder: it holds no job.toml")
    try:
        job = jobfile.load(folder / "job.toml", data_files=False)  # the folder alone: its data may be gone
    except FileNotFoundError as err:
        raise GadeiError(f"{run_dir} is not a finished `gadei run` folder: {err.filename} is missing") from None
    # a job that picked its model: the chosen candidate's run, or each member's of the candidates' mean
    members = [_Model(run_dir, f) for f in (outputs.model_folders(folder) if job.workload == jobfile.AUTO
                                            else [folder])]
    labels = members[0].labels
    for other in members[1:]:
        if other.labels != labels:
            raise GadeiError(f"{run_dir}: the labels of {other.folder} are not those of {members[0].folder}, so "
                             "their mean cannot be taken")
    weights = ensemble.weights_of(outputs.read_result(folder) or {} if len(members) > 1 else {},
                                  [m.folder.name for m in members], folder / "result.json")
    answers = []
    for xs in [[m.encoded(text) for m in members] for text in texts]:  # every text checked before any answer
        with torch.no_grad():
            probs = sum(w * torch.softmax(m.model(x), dim=-1)[0] for w, m, x in zip(weights, members, xs))
        best = torch.topk(probs, min(top, len(labels)))
        answers.append([(labels[i], float(p)) for p, i in zip(best.values.tolist(), best.indices.tolist())])
    return answers


class _Model:
    """The model of one run folder (job.toml, labels.json, the vocabulary or the features' scale,
    model.pt), ready to predict; `run_dir`: the folder asked about, for the errors."""

    def __init__(self, run_dir: str, folder: Path):
        from gadei_workloads import get
        from gadei_workloads.text import Vocab

        self.folder = folder
        if not (folder / "job.toml").is_file():  # jobfile.load would say only that a job file is missing
            raise GadeiError(f"{run_dir} is not a finished `gadei run` folder: {folder / 'job.toml'} is missing")
        try:
            self.job = jobfile.load(folder / "job.toml", data_files=False)
            self.labels = _read_json(folder / "labels.json")
            if not isinstance(self.labels, list) or len(self.labels) < 2 or \
                    not all(isinstance(label, str) for label in self.labels):
                raise GadeiError(f"{folder / 'labels.json'}: not the list of two labels or more `gadei run` wrote")
            state = _load_model(folder / "model.pt")
            self.workload = get(self.job.workload)
            if self.workload.kind == "numeric":
                self.stats = _features(folder / "features.json")
            else:
                self.vocab = Vocab.from_json(_read_json(folder / "vocab.json"))
        except FileNotFoundError as err:
            raise GadeiError(f"{run_dir} is not a finished `gadei run` folder: {err.filename} is missing") from None
        except (KeyError, TypeError, AttributeError) as err:
            raise GadeiError(f"{run_dir}: its label or vocabulary map is not one `gadei run` wrote ({err!r})") from None
        size = self.stats["features"] if self.workload.kind == "numeric" else len(self.vocab)
        self.model = self.workload.build_from_maps(size, len(self.labels), self.job.train.seed)
        try:
            self.model.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as err:
            raise GadeiError(f"{folder / 'model.pt'}: does not fit the {self.job.workload} model of "
                             f"{folder / 'job.toml'}, labels.json and the vocabulary: "
                             f"{_first_lines(str(err))}") from None
        self.model.eval()

    def encoded(self, text: str):
        """`text` as the model's input (a batch of one).

        Raises:
            GadeiError: a text with no words, or features that are not the model's.
        """
        import numpy as np
        import torch
        from gadei_workloads.text import tokenize

        if self.workload.kind != "numeric":
            words = tokenize(text)[: self.job.data.max_words]  # as its training texts were cut
            if not words:  # the model would answer from padding alone, as if it had read something
                raise GadeiError(f"{text!r}: no words to predict from; give a text")
            # the n-grams it was trained on, padded to the widest filter
            ids = self.vocab.encode(self.workload.tokens(words) if self.workload.tokens else words)
            return torch.tensor([ids + [0] * max(0, getattr(self.model, "min_len", 1) - len(ids))])
        features = self.stats["features"]
        try:
            values = np.array([float(v) for v in text.replace(",", " ").split()], dtype=np.float64)
        except ValueError:
            raise GadeiError(f"{text!r}: give the {features} features as numbers separated by commas") from None
        if values.size != features:
            raise GadeiError(f"{text!r}: {values.size} features, the model takes {features}")
        return torch.from_numpy(((values - np.array(self.stats["mean"])) / np.array(self.stats["std"]))
                                .astype(np.float32))[None]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise GadeiError(f"{path}: not the JSON `gadei run` wrote ({err})") from None


def _features(path: Path) -> dict:
    """features.json as `gadei run` writes it: the count of the features, and the mean and the
    (nonzero) standard deviation of each in the training set, which a sample is scaled by."""
    stats = _read_json(path)
    count = stats.get("features") if isinstance(stats, dict) else None
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 1 and _numbers(stats.get("mean"), count)
            and _numbers(stats.get("std"), count) and min(stats["std"]) > 0):
        raise GadeiError(f"{path}: not the count of the features and each one's mean and standard deviation "
                         "`gadei run` wrote")
    return stats


def _numbers(values, count: int) -> bool:
    """Whether `values` is a list of `count` finite numbers, none a boolean."""
    return isinstance(values, list) and len(values) == count and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _first_lines(text: str, limit: int = 300) -> str:
    joined = " ".join(line.strip() for line in text.splitlines()[:3] if line.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def _load_model(path: Path) -> dict:
    """The state dict in `path`, read as plain tensors only (`weights_only`: a pickled object
    that names code is refused, never run)."""
    import torch

    try:
        with warnings.catch_warnings():  # torch warns about old pickle protocols before refusing them
            warnings.simplefilter("ignore")
            state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as err:  # any bytes may be handed to us: whatever torch's reader trips on is the file's fault
        text = str(err)
        named = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
        if named:  # torch's own message goes on to suggest weights_only=False: not advice to print
            why = f"it names code ({named.group(1)}), which a model file never does; refused, nothing was run"
        elif isinstance(err, pickle.UnpicklingError):
            why = "it is not a pickle of tensors that PyTorch reads without running code"
        else:
            why = _first_lines(text) or type(err).__name__
        raise GadeiError(f"{path}: not a model file gadei wrote (a PyTorch state dict of tensors): {why}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise GadeiError(f"{path}: not a model file gadei wrote: it holds a {type(state).__name__}, not a state "
                         "dict of tensors")
    return state
