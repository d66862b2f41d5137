"""``nam plot`` (cli/plot.py): a PNG of a tiny run's curves, another run overlaid; fail-closed without matplotlib
and on a folder with nothing to plot."""

import json
import sys
import textwrap

import pytest

from nam_cli.main import run
from nam_core.engine.metrics import read_metrics
from nam56r.testing import prepare_corpus

pytest.importorskip("matplotlib", reason="nam's plot extra (in the test extra: CI has it)")


def test_a_tiny_run_and_another_overlaid_to_a_png(tmp_path, tmp_path_factory, capsys):
    from nam_cli.plot import PANELS, draw

    corpus = prepare_corpus(tmp_path_factory, (textwrap,), chars=4000)
    tiny = tmp_path / "tiny"
    assert run(["train", "--run-dir", str(tiny), "--data", str(corpus), "--max-steps", "2", "--set", "seq_len=32",
                "--set", "train.micro_batch_size=2", "--set", "train.checkpoint_every=0", "-q"]) == 0
    other = tmp_path / "other"  # a run that evaluated: its val_loss points are drawn
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 6.0 - s, "lm_loss": 5.0 - s, "lr": 1e-3 * s, "grad_norm": 1.0 / s, "tokens_per_s": 100.0 * s,
         **({"val_loss": 5.5 - s} if s % 2 == 0 else {})}) + "\n" for s in range(1, 5)))

    png = tmp_path / "curves.png"
    assert run(["plot", str(tiny), str(other), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png} (2 runs: tiny, other)" in capsys.readouterr().out

    fig = draw([tiny, other])  # what the PNG shows: each panel's lines are the runs' logged values
    metrics = read_metrics(tiny)
    panels = dict(zip((f for f, _ in PANELS), fig.axes))
    tiny_loss, other_loss = panels["lm_loss"].get_lines()
    assert list(tiny_loss.get_xdata()) == [1, 2] and list(tiny_loss.get_ydata()) == [m["lm_loss"] for m in metrics]
    assert list(other_loss.get_ydata()) == [4.0, 3.0, 2.0, 1.0]
    (val,) = panels["val_loss"].get_lines()  # the tiny run did not evaluate: one line, the other run's
    assert list(val.get_xdata()) == [2, 4] and list(val.get_ydata()) == [3.5, 1.5]
    assert [list(l.get_ydata()) for l in panels["tokens_per_s"].get_lines()][0] == [m["tokens_per_s"] for m in metrics]


def test_a_folder_without_metrics_is_an_error(tmp_path, capsys):
    assert run(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no metrics.jsonl records to plot" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_it_says_what_to_install(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "needs the 'matplotlib' package" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_plot_that_fails_while_saving_leaves_the_old_png_and_a_missing_folder_is_refused(tmp_path, monkeypatch,
                                                                                          capsys):
    """The PNG is rendered first and renamed into place: a save that raises partway (here after writing some
    bytes) leaves the previous file as it was and no temporary file; --out in a folder that is not there is an
    error before anything is drawn."""
    from matplotlib.figure import Figure

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    png = tmp_path / "x.png"
    png.write_bytes(b"the previous plot")
    real = Figure.savefig

    def torn(self, target, **kw):
        real(self, target, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(OSError):
        run(["plot", str(tmp_path), "--out", str(png)])
    assert png.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "x.png"]
    monkeypatch.undo()

    assert run(["plot", str(tmp_path), "--out", str(tmp_path / "missing" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and "mkdir -p" in err
    assert not (tmp_path / "missing").exists()


def test_a_run_killed_mid_write_plots_without_its_torn_last_line_and_a_damaged_line_is_named(tmp_path, capsys):
    lines = [json.dumps({"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0})
             for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "loss": 5.1, "lm_lo')
    png = tmp_path / "x.png"
    assert run(["plot", str(tmp_path), "--out", str(png)]) == 0
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    assert run(["plot", str(tmp_path), "--out", str(png)]) == 4
    assert "metrics.jsonl line 2 is not a JSON record: 'not json'" in capsys.readouterr().err
