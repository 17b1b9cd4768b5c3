"""``gspo-report`` on real ``gspo-train`` runs (the tiny recipe, 4 RL steps on CPU): the PNGs and a
self-contained HTML page, the page rendered by a headless browser, two runs on the same axes."""

import base64
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from gspo_megatron.tools import report
from tests.e2e.test_train_e2e import gspo_train

pytestmark = pytest.mark.slow
pytest.importorskip("matplotlib")

STEPS = ["--trainer.steps=4", "--trainer.eval_interval=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs: one with the routing diagnostics (every plot has data), one with another seed
    and no routing metrics."""
    base = tmp_path_factory.mktemp("runs")
    gspo_train(base / "diag", *STEPS, "--routing.diagnostics=true")
    gspo_train(base / "seed7", *STEPS, "--trainer.seed=7")
    return base / "diag", base / "seed7"


class PageParts(HTMLParser):
    """Every tag's name and attributes of a page."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_report_of_a_run_writes_the_plots_and_a_self_contained_page(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.main([str(runs[0]), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"gspo-report: wrote {out / 'report.html'} (8 plots)\n"
    pngs = sorted(p.file for p in report.PLOTS)
    assert sorted(os.listdir(out)) == sorted(pngs + ["report.html"])
    parts = PageParts()
    parts.feed((out / "report.html").read_text())
    images = [attrs["src"] for tag, attrs in parts.tags if tag == "img"]
    assert len(images) == 8
    embedded = {base64.b64decode(src.removeprefix("data:image/png;base64,")) for src in images}
    assert embedded == {(out / name).read_bytes() for name in pngs}  # the PNGs themselves
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in embedded)
    # nothing fetched: no script, stylesheet link or reference outside the page
    refs = [v for _, attrs in parts.tags for k, v in attrs.items() if k in ("src", "href")]
    assert all(v.startswith("data:") for v in refs)
    assert not any(tag in ("script", "link", "iframe") for tag, _ in parts.tags)


def _browser() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))),
                None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser (apt-get install chromium)")
def test_the_page_renders_in_a_headless_browser(runs, tmp_path):
    """Chromium opens the page from disk with every host unresolvable and takes a screenshot:
    the plots are there (matplotlib's first colour, the runs' lines, covers thousands of pixels;
    the page's own text and table are black and grey)."""
    import matplotlib.image

    out = tmp_path / "report"
    assert report.main([str(runs[0]), "--out", str(out)]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1400,2400",
                    f"--screenshot={shot}", (out / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=60, cwd=tmp_path)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1400)
    blue = ((abs(pixels[..., 0] - 0x1f / 255) < 0.08) & (abs(pixels[..., 1] - 0x77 / 255) < 0.08)
            & (abs(pixels[..., 2] - 0xb4 / 255) < 0.08)).sum()
    assert blue > 3000, blue


def test_two_runs_on_the_same_axes(runs, tmp_path, capsys):
    out = tmp_path / "compare"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0
    assert capsys.readouterr().out.endswith("(8 plots)\n")  # one run with routing metrics suffices
    page = (out / "report.html").read_text()
    assert "gspo-report: diag, seed7" in page

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [report.load_run(str(path), path.name) for path in runs]
    for plot in report.PLOTS:
        if plot.file in ("route_change.png", "expert_load.png"):
            continue  # a panel per run
        fig = plot.draw(loaded, plt)
        legends = [{t.get_text() for t in ax.get_legend().get_texts()}
                   for ax in fig.axes if ax.get_legend() is not None]
        assert legends and all(labels == {"diag", "seed7"} for labels in legends), (plot.file, legends)
        plt.close(fig)
    # the two runs differ (another seed), so the lines are two, not one drawn twice
    a, b = (report.series(r.rows, "reward/mean")[1] + report.series(r.rows, "optim/grad_norm")[1]
            for r in loaded)
    assert a != b
