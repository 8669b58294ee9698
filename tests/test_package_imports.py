"""What the package imports is what setup.py declares (the static half of tests/import_all.py,
which .ci/run also runs in full after a plain `pip install -e .`)."""
import os

from import_all import ROOT, undeclared_imports


def test_every_import_is_declared():
    assert undeclared_imports(os.path.join(ROOT, "dspark")) == []


def test_an_undeclared_import_is_found(tmp_path):
    (tmp_path / "mod.py").write_text("import os\nimport scipy.stats\n"
                                     "def f():\n    import matplotlib\n"
                                     "try:\n    import flash_mla\nexcept ImportError:\n    pass\n")
    bad = undeclared_imports(str(tmp_path))
    assert len(bad) == 1 and "imports 'scipy.stats'" in bad[0] and "install_requires" in bad[0]
