"""A training run's learning curve: ``OUT/curve.csv`` (one row per step and per evaluation) and
``OUT/curve.png`` (loss, and EM/F1 of the periodic evaluations, against the step).

The driver appends a row per optimizer step and per evaluation as they arrive, so the CSV is
complete up to the moment a run stops; a resumed run drops the rows after its checkpoint's step
first, so the curve never holds the same step twice. The PNG is redrawn at every evaluation and
at the end:

    curve = Curve(Path("OUT"), start_step=0)
    curve.step(10, loss=1.2, lr=1e-4, grad_norm=3.0, examples_per_s=12.5)
    curve.evaluation(10, exact=40.0, f1=50.0)
    curve.plot()
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

FIELDS = ("step", "kind", "loss", "lr", "grad_norm", "examples_per_s", "exact", "f1")


class Curve:
    """Appends to ``OUT/curve.csv`` and draws ``OUT/curve.png``."""

    def __init__(self, out: Path, *, start_step: int) -> None:
        self.csv_path = out / "curve.csv"
        self.png_path = out / "curve.png"
        kept = []
        if self.csv_path.is_file():
            with self.csv_path.open(newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= start_step]
        with self.csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(kept)

    def _append(self, row: dict[str, object]) -> None:
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=FIELDS).writerow(row)

    def step(self, step: int, *, loss: float, lr: float, grad_norm: float, examples_per_s: float) -> None:
        self._append(
            {
                "step": step,
                "kind": "train",
                "loss": f"{loss:.6g}",
                "lr": f"{lr:.6g}",
                "grad_norm": f"{grad_norm:.6g}",
                "examples_per_s": f"{examples_per_s:.4g}",
            }
        )

    def evaluation(self, step: int, *, exact: float, f1: float) -> None:
        self._append({"step": step, "kind": "eval", "exact": f"{exact:.4f}", "f1": f"{f1:.4f}"})

    def rows(self) -> list[dict[str, str]]:
        with self.csv_path.open(newline="") as f:
            return list(csv.DictReader(f))

    def plot(self) -> Path | None:
        """Draw the PNG (loss with a moving average; EM/F1 on a second panel); None without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed: %s not drawn", self.png_path)
            return None
        rows = self.rows()
        train = [(int(r["step"]), float(r["loss"])) for r in rows if r["kind"] == "train"]
        evals = [(int(r["step"]), float(r["exact"]), float(r["f1"])) for r in rows if r["kind"] == "eval"]
        fig, (ax_loss, ax_f1) = plt.subplots(1, 2, figsize=(11, 4))
        if train:
            steps, losses = zip(*train, strict=True)
            ax_loss.plot(steps, losses, lw=0.5, alpha=0.4, label="loss per step")
            window = max(1, len(losses) // 50)
            smooth = [
                sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax_loss.plot(steps, smooth, lw=1.5, label=f"moving average ({window} steps)")
            ax_loss.legend()
        ax_loss.set(xlabel="optimizer step", ylabel="span loss", title="training loss")
        if evals:
            steps, exact, f1 = zip(*evals, strict=True)
            ax_f1.plot(steps, f1, "o-", label="F1")
            ax_f1.plot(steps, exact, "s-", label="exact match")
            best = max(f1) if not any(math.isnan(v) for v in f1) else float("nan")
            ax_f1.set_title(f"evaluation (best F1 {best:.2f})")
            ax_f1.legend()
        else:
            ax_f1.set_title("evaluation (none yet)")
        ax_f1.set(xlabel="optimizer step", ylabel="score (%)")
        ax_f1.grid(alpha=0.3)
        ax_loss.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        plt.close(fig)
        return self.png_path
