"""The masc command: help, subcommands, one-line errors."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

from masc_gadget.cli import main

from tests.conftest import CONFIGS


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "masc_gadget.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "simulate" in out.stdout
    for sub in (["simulate", "--help"], ["simulate", "dataset", "--help"], ["simulate", "sphere", "--help"]):
        out = subprocess.run([sys.executable, "-m", "masc_gadget.cli", *sub], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "usage: masc simulate" in out.stdout


def test_sphere_command_writes_field_map(tmp_path, capsys):
    out = tmp_path / "sphere.h5"
    rc = main(["simulate", "sphere", "--radius-mm", "5", "--chi-ppm", "180", "--b0", "1.5",
               "--voxel-mm", "1", "--out", str(out)])
    assert rc == 0
    assert "max |numeric - analytic| / peak" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        field = f["field_hz"]
        assert field.shape == (40, 40, 40)
        assert field.attrs["radius_mm"] == 5 and field.attrs["chi_ppm"] == 180 and field.attrs["b0_t"] == 1.5
        assert field.attrs["voxel_mm"] == 1
        assert f.attrs["max_rel_error_1.5_to_3.5_radii"] < 0.03
        assert np.abs(field[()]).max() > 1000


def test_preview_command(tiny_dataset, tmp_path, capsys):
    out = tmp_path / "preview.png"
    assert main(["simulate", "preview", str(tiny_dataset), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv,message",
    [
        (["simulate", "preview", "{data}", "--subject", "sub-9999", "--out", "{tmp}/p.png"],
         "subject 'sub-9999' is not in"),
        (["simulate", "preview", "{tmp}/nothing", "--out", "{tmp}/p.png"], "manifest.json is missing"),
        (["simulate", "dataset", "--config", "{cfg}", "--set", "sequence.nope=1", "--out", "{tmp}/d"],
         "unknown key sequence.nope"),
        (["simulate", "dataset", "--set", "sequence.matrix=[31, 32]", "--out", "{tmp}/d"], "matrix sizes must be even"),
        (["simulate", "sphere", "--radius-mm", "-1", "--chi-ppm", "9", "--out", "{tmp}/s.h5"], "must be > 0"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, message, tiny_dataset, tmp_path, capsys):
    argv = [a.format(data=tiny_dataset, tmp=tmp_path, cfg=CONFIGS / "tiny.yaml") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_dataset_command(tmp_path, capsys):
    out = tmp_path / "d"
    rc = main(["simulate", "dataset", "--config", str(CONFIGS / "tiny.yaml"), "--subjects", "1",
               "--set", "dataset.split_fractions=[0.0, 0.0, 1.0]", "--out", str(out)])
    assert rc == 0
    assert "dataset written to" in capsys.readouterr().out
    assert [p.name for p in out.glob("*/*.h5")] == ["sub-0000.h5"]
    assert (out / "test" / "sub-0000.h5").is_file()


class _MissingExtra:
    """An entry point whose package needs a dependency that is not installed."""

    name = "ghost"
    group = ""

    def load(self):
        raise ModuleNotFoundError("No module named 'gymnasium'", name="gymnasium")


def _with_ghost(real, ghost_group):
    def entry_points(**kw):
        found = real(**kw)
        return [*found, _MissingExtra()] if kw.get("group") == ghost_group else found
    return entry_points


def test_command_of_a_missing_extra_says_what_to_install(monkeypatch, capsys):
    import masc_gadget.cli as cli

    monkeypatch.setattr(cli.metadata, "entry_points", _with_ghost(cli.metadata.entry_points, cli.COMMANDS_GROUP))
    assert "unavailable: needs gymnasium" in cli.build_parser().format_help()
    assert main(["ghost", "anything", "--here"]) == 2
    err = capsys.readouterr().err
    assert "masc ghost needs gymnasium, which is not installed" in err
    assert "pip install 'masc[train]'" in err


def test_config_section_of_a_missing_extra_is_kept_unvalidated(monkeypatch):
    import masc_gadget.config as config

    monkeypatch.setattr(config.metadata, "entry_points", _with_ghost(config.metadata.entry_points,
                                                                   config.SECTIONS_GROUP))
    built = config.build_config({"ghost": {"anything": [1, 2]}, "acquisition": {"budget": 4}})
    assert built["ghost"] == {"anything": [1, 2]}
    assert built["acquisition"].budget == 4  # installed sections are still validated
    with pytest.raises(config.ConfigError, match="acquisition"):
        config.build_config({"ghost": {}, "acquisition": {"budget": "x"}})


def test_help_loads_neither_torch_nor_the_training_stack():
    """``masc --help`` and every subcommand's ``--help`` build the whole parser: it must not import
    torch (seconds on a loaded machine), the trainers or the servers."""
    import subprocess
    import sys

    code = ("import sys; from masc_gadget.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'scipy', 'h5py', 'training.data', 'masc_gadget.serving.server') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"imported by the parser: {done.stdout.strip()} {done.stderr[-500:]}"


def test_old_spellings_become_the_command_trees_with_a_note():
    from masc_gadget.cli import spelled

    assert spelled(["mar-check", "--mar", "x"]) == (["check", "mar", "--mar", "x"],
                                                    ["'masc mar-check' is now 'masc check mar'"])
    assert spelled(["refit", "c.pt"])[0] == ["train", "refit", "c.pt"]
    assert spelled(["study", "sim-params", "--out", "o"])[0] == ["check", "sim-params", "--out", "o"]
    assert spelled(["eval", "combine", "a,b", "--out", "o"]) == (["eval", "--combine", "a,b", "--out", "o"], [])
    assert spelled(["eval", "suite", "--runs", "r"])[0] == ["eval", "--suite", "paper", "--runs", "r"]
    assert spelled(["check", "headroom", "from", "d"])[0] == ["check", "headroom", "--from", "d"]
    argv, notes = spelled(["eval", "--combine", "a,b"])
    assert argv == ["eval", "--combine", "a,b"] and notes == ["'masc eval --combine' is now 'masc eval combine DIR,DIR'"]
    argv, notes = spelled(["headroom", "--combine", "a"])
    assert argv[:2] == ["check", "headroom"] and len(notes) == 2
    assert spelled(["serve", "--port", "1"]) == (["serve", "--port", "1"], [])


def test_the_models_commands(capsys):
    from masc_gadget.models.shipped import RECOMMENDED

    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith(f"shipped:{RECOMMENDED}:") and "recommended" in listed[0]
    assert main(["models", "info", "shipped:fixed_small"]) == 0
    info = capsys.readouterr().out
    assert '"kind": "fixed-order"' in info and '"protocol"' in info and '"git_commit"' in info
    assert main(["export", "shipped:fixed_small"]) == 2  # the old spelling still reaches models export
    assert "'masc export' is now 'masc models export'" in capsys.readouterr().err
