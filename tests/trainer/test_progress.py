"""Progress lines on long waits (trainer.core.progress): share, rate and ETA from a clock the test drives, and the
model download's byte count (trainer.download_model.bytes_under)."""

from __future__ import annotations

from trainer.download_model import bytes_under
from trainer.core.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_at_most_every_period_with_rate_and_eta_and_always_the_last():
    clock, lines = Clock(), []
    progress = Progress("[eval] base echo", 40, "episodes", lines.append, every_s=10, clock=clock)
    clock.now += 5
    progress.update(10)   # the first line comes at once
    clock.now += 5
    progress.update(20)   # 5 s later: not yet
    clock.now += 5
    progress.update(30)   # 10 s after the first
    clock.now += 1
    progress.update(40)   # the last, whenever it comes
    assert lines == ["[eval] base echo: 10/40 episodes (25%), 2.00 episodes/s, ETA 15 s",
                     "[eval] base echo: 30/40 episodes (75%), 2.00 episodes/s, ETA 5 s",
                     "[eval] base echo: 40/40 episodes (100%), 2.50 episodes/s"]


def test_bytes_read_as_sizes_and_an_unknown_total_gives_no_eta():
    clock, lines = Clock(), []
    progress = Progress("[model-download] org/model", 3 << 30, "B", lines.append, clock=clock)
    clock.now += 64
    progress.update(1 << 30)
    assert lines == ["[model-download] org/model: 1.0 GiB of 3.0 GiB (33%), 16.0 MiB/s, ETA 2 min 08 s"]
    unknown = Progress("[model-download] org/model", None, "B", lines.append, clock=clock)
    clock.now += 2
    unknown.update(4 << 20)
    assert lines[-1] == "[model-download] org/model: 4.0 MiB, 2.0 MiB/s"


def test_download_progress_counts_blobs_being_written_not_the_snapshot_links(tmp_path):
    repo = tmp_path / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "aaa").write_bytes(b"x" * 1000)
    (repo / "blobs" / "bbb.incomplete").write_bytes(b"x" * 500)
    (repo / "snapshots" / "c0ffee").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee" / "model.safetensors").symlink_to(repo / "blobs" / "aaa")
    assert bytes_under(repo) == 1500
    assert bytes_under(tmp_path / "missing") == 0
