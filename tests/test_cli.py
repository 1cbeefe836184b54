import json
import subprocess
import sys

import pytest

from amla_sim import __version__
from amla_sim.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "lemma" in capsys.readouterr().out


def test_lemma_table(capsys):
    assert main(["lemma"]) == 0
    out = capsys.readouterr().out
    assert "126 * 2^23" in out and "1056964608" in out and "0xfe800000" in out


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "fp64"])
def test_lemma_json_marks_domain(capsys, fmt):
    assert main(["lemma", "--format", fmt, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["examples"]
    assert all(r["bitwise_equal"] for r in rows if r["in_domain"])
    assert not any(r["bitwise_equal"] for r in rows if r["case"].startswith("out:"))
    assert rows[0]["x_bits"] in ("0x3f000000", "0x3800", "0x3f00", "0x3fe0000000000000")


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "amla_sim.cli", "lemma"], capture_output=True, text=True, check=True)
    assert "Lemma 3.1" in r.stdout


def test_run_json_has_the_public_keys(capsys):
    assert main(["run", "--algorithm", "amla", "--heads", "8", "--context", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("rel_frobenius", "rmse", "cos_diff", "hazards"):
        assert key in report
    assert 1e-4 < report["rel_frobenius"] < 1e-2


def test_run_bad_input_is_a_message_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--algorithm", "base", "--context", "0"])
    assert e.value.code == 2
    assert "context" in capsys.readouterr().err
