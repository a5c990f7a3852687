"""The loss curve of a training run (and the held-out answer accuracy, where it was measured), as a PNG."""

from __future__ import annotations

import pathlib


def plot_losses(log_history: list[dict], path: pathlib.Path) -> None:
    """Train and eval loss against the step, from a Trainer's `log_history`; accuracy on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        points = [(e["step"], e[key]) for e in log_history if key in e]
        if points:
            axis.plot(*zip(*points, strict=True), marker="." if key == "eval_loss" else None, label=label)
    accuracy = [(e["step"], e["eval_answer_accuracy"]) for e in log_history if "eval_answer_accuracy" in e]
    if accuracy:
        right = axis.twinx()
        right.plot(*zip(*accuracy, strict=True), color="tab:green", marker="o", label="held-out answer accuracy")
        right.set_ylabel("accuracy")
        right.set_ylim(0, 1)
        right.legend(loc="upper center")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
