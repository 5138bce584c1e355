import pytest

from ballast.cli import main


def test_ballast_sim_prints_markdown_tables(capsys):
    assert main(["sim", "placement", "--engines", "4", "--seconds", "5"]) == 0
    out = capsys.readouterr().out
    assert "| affinity |" in out and "| round_robin |" in out and "round-robin's" in out
    assert main(["sim", "fleet", "--regions", "2", "--engines-per-region", "4", "--minutes", "0.05", "--rate",
                 "3000"]) == 0
    out = capsys.readouterr().out
    assert "| priority |" in out and "requests per CPU second" in out
    assert main(["sim", "quota", "--regions", "3", "--minutes", "1"]) == 0
    assert "| synchronous |" in capsys.readouterr().out
    assert main(["sim", "fairness", "--engines", "1", "--seconds", "3", "--light-tenants", "2"]) == 0
    out = capsys.readouterr().out
    assert "| vtc | 0 (heavy) |" in out and "| fcfs | 2 |" in out
    assert main(["sim", "grouping", "--engines", "2", "--items", "300", "--prefixes", "4"]) == 0
    out = capsys.readouterr().out
    assert "| grouped |" in out and "| shared |" in out


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "placement", "--engines", "0"])
