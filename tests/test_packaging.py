"""The explicit package list in pyproject.toml must cover every Python package."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_python_package_is_listed_in_pyproject() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("daisyweb", "kernels", "signaling")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set(), "add these packages to pyproject.toml"
    assert conf["package-dir"]["signaling.static"] == "static"
    assert (ROOT / "static" / "index.html").is_file()
