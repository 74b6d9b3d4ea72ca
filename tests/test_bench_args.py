"""The benches' --results stem (bench/_common.py): a results file is named only by a checked stem,
so a bad name - an empty one included - never writes over another CPU's figures."""
import argparse

import pytest

from bench._common import add_results_option, results_name


@pytest.mark.parametrize("given", ["", "Bad-Name", "../x", "a" * 65, "x.json", "prefill attention"])
def test_a_bad_results_stem_is_refused_with_an_error_line(given, capsys):
    ap = argparse.ArgumentParser(prog="bench")
    add_results_option(ap, "prefill_attention")
    args = ap.parse_args(["--results", given])
    with pytest.raises(SystemExit) as e:
        results_name(ap, args.results, "prefill_attention")
    assert e.value.code == 2
    assert f"bench: error: --results must be 1-64 characters of a-z, 0-9 and _ (a file stem), got {given!r}" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [([], "prefill_attention"), (["--results", "prefill_attention_zen4"],
                                                                     "prefill_attention_zen4")])
def test_a_good_results_stem_or_none_gives_the_stem_or_the_default(argv, want):
    ap = argparse.ArgumentParser(prog="bench")
    add_results_option(ap, "prefill_attention")
    assert results_name(ap, ap.parse_args(argv).results, "prefill_attention") == want
