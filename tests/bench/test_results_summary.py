"""bench/RESULTS.md opens with a summary generated from the run files it cites (bench/results_summary.py): the block
must be what the runs give, so it cannot drift from them, and a cited file that is gone is a clear error."""

import json

import pytest

from bench import results_summary as rs


def test_the_block_in_results_md_is_what_the_cited_runs_give():
    text = (rs.ROOT / rs.RESULTS).read_text()
    assert rs.current_block(text) == rs.summary(), \
        "bench/RESULTS.md's summary is stale: run `python -m bench.results_summary --write`"
    assert text.index(rs.BEGIN) < text.index("\n## "), "the summary opens the file, before the journal"


def test_every_figure_comes_from_its_file_with_the_run_it_was_taken_in():
    block = rs.summary()
    for run in rs.CITED:
        data = json.loads((rs.ROOT / run.path).read_text())
        assert run.path in block and run.command in block
        assert data["params"]["commit"][:7] in block
        for by_conc in data["runs"].values():
            for result in by_conc.values():
                assert f"{result['tok_s']:.1f}" in block


def test_a_missing_cited_file_fails_naming_it(tmp_path, monkeypatch, capsys):
    gone = rs.CitedRun("Short prompts", "bench/plots/peer_serve_gone.json", "python -m bench.peer_serve")
    with pytest.raises(rs.MissingRun, match="bench/plots/peer_serve_gone.json.*not found"):
        rs.summary(root=tmp_path, cited=(gone,))
    monkeypatch.setattr(rs, "CITED", (gone,))
    assert rs.main([]) == 2
    assert "peer_serve_gone.json" in capsys.readouterr().err


def test_write_replaces_only_the_block_and_keeps_the_journal():
    journal = "Machine: ...\n\n## Engine (issue 2), 2026-11-22\n\nfigures\n"
    fresh = rs.replace_block("# Benchmark results\n\n" + journal, "BLOCK\n")
    assert fresh == "# Benchmark results\n\nBLOCK\n\n" + journal
    old = f"# Benchmark results\n\n{rs.BEGIN}\nold\n{rs.END}\n\n" + journal
    new_block = f"{rs.BEGIN}\nnew\n{rs.END}\n"
    assert rs.replace_block(old, new_block) == f"# Benchmark results\n\n{new_block}\n" + journal
    assert rs.current_block(rs.replace_block(old, new_block)) == new_block
