"""The logging window: loss, accuracy and timings since the last log line, summed on the device.
So the host waits for the GPU once per window, not once per step."""

from __future__ import annotations

import time

import torch

from dlstore.train.dist import DistContext

__all__ = ["StepWindow"]


class StepWindow:
    """Sums over the steps since the last log line, on the device, with no host sync per step.

    >>> w = StepWindow(torch.device("cpu"))
    >>> w.add(torch.tensor(2.0), torch.eye(3), torch.tensor([0, 1, 1]))
    >>> w.samples, w.correct.item()
    (3, 2.0)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.correct = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0
        self.steps = 0
        self.data_s = 0.0
        self.compute_s = 0.0
        self.lr = 0.0  # the rate of the window's last step

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = labels.numel()
        self.loss_sum += loss.detach().double() * n
        self.correct += (logits.detach().argmax(1) == labels).sum().double()
        self.samples += n
        self.steps += 1

    def reduce(self, ctx: DistContext) -> dict:
        """The window over all ranks: loss, top1, samples, img_per_s and where the time went."""
        # The window's one host-device sync, and one all-reduce for all three sums. On a GPU
        # the loop runs ahead of the device until this sync. The wait is the window's compute
        # time, or img/s would be overstated. `torch.full`, not `torch.tensor`: a blocking
        # copy from the host would sync before the clock starts.
        waited = time.perf_counter()
        count = torch.full((), float(self.samples), dtype=torch.float64, device=self.device)
        sums = torch.stack([self.loss_sum, self.correct, count])
        loss_sum, correct, samples = ctx.all_reduce_sum(sums).tolist()
        self.compute_s += time.perf_counter() - waited
        wall = self.data_s + self.compute_s
        return {
            "loss": loss_sum / samples,
            "top1": correct / samples,
            "samples": int(samples),
            "img_per_s": samples / wall if wall > 0 else None,
            "data_wait_pct": 100.0 * self.data_s / wall if wall > 0 else None,
            "data_wait_ms": 1000.0 * self.data_s / self.steps,
            "compute_ms": 1000.0 * self.compute_s / self.steps,
        }

    def state(self) -> dict:
        # Each rank's own, unreduced sums. Restored on the same rank, they reproduce exactly
        # the sums and logged means of an uninterrupted run.
        return {
            "loss_sum": self.loss_sum.item(),
            "correct": self.correct.item(),
            "samples": self.samples,
            "steps": self.steps,
            "data_s": self.data_s,
            "compute_s": self.compute_s,
            "lr": self.lr,
        }

    def load(self, state: dict) -> None:
        self.reset()
        self.loss_sum.fill_(state["loss_sum"])
        self.correct.fill_(state["correct"])
        self.samples, self.steps, self.lr = state["samples"], state["steps"], state["lr"]
        self.data_s, self.compute_s = state["data_s"], state["compute_s"]

    def load_merged(self, states: list[dict], first: bool) -> None:
        """The saved windows of another number of ranks, their sums all on the `first` rank.

        The next log line's all-reduce then gives the means of an uninterrupted run."""
        self.load({**states[0], "loss_sum": 0.0, "correct": 0.0, "samples": 0})
        if first:
            self.loss_sum.fill_(sum(state["loss_sum"] for state in states))
            self.correct.fill_(sum(state["correct"] for state in states))
            self.samples = sum(state["samples"] for state in states)
