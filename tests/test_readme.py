"""README.md is the user's manual: its reference part is generated from the config dataclasses, so a new
key cannot go undocumented; and its quick start names the commands CI and users run."""

import importlib.util

from helpers import ROOT


def _make_readme():
    spec = importlib.util.spec_from_file_location("make_readme", ROOT / "docs" / "make_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_reference_is_current():
    mk = _make_readme()
    text = (ROOT / "README.md").read_text()
    assert mk.MARKER in text
    assert text.split(mk.MARKER, 1)[1].strip() == mk.render().strip(), "run: python docs/make_readme.py"


def test_every_section_key_is_in_the_readme():
    import dataclasses

    from lit_moe.config import CheckpointConfig, ParallelismConfig, TrainingConfig

    text = (ROOT / "README.md").read_text()
    for cls in (CheckpointConfig, TrainingConfig, ParallelismConfig):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f.name


def test_quick_start_and_ci_run_the_same_test_command():
    text = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "lit_moe fit --config configs/tiny.yaml" in text
    command = "python -m pytest -q -n 3 --dist loadfile --durations=20"   # the slowest tests named on every run
    assert command in text and command in ci
