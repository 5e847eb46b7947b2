"""`pipetorch report DIR`, `pipetorch report compare A B` and report.html's content."""
import argparse
import re

import pytest
from profiling_fakes import local_compiled, options, process_compiled, run_calls

from pipetorch.cli import report as report_cli
from pipetorch.profiling.compare import Row, rows
from pipetorch.profiling.recorder import Profiler, load


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two fake runs: sharded (bubble 1/2) and pipelined (bubble 1/5), same model."""
    root = tmp_path_factory.mktemp("reports")
    out = {}
    for schedule in ("sharded", "pipelined"):
        compiled = process_compiled(schedule)
        profiler = Profiler(root / schedule, compiled, training=True, options=options())
        run_calls(profiler, compiled, calls=2)
        out[schedule] = profiler.write()
    return out


def cli(argv):
    parser = argparse.ArgumentParser(prog="pipetorch")
    report_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.command(args)


def test_report_prints_the_summary_and_the_page(reports, capsys):
    assert cli(["report", str(reports["pipelined"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Linear2 (training), processes engine, pipelined schedule\n")
    assert "stage 0 on IPU 0: blocks B1; parameters 56" in out
    assert "bubble: measured 20.0%, theoretical 20.0% ((S-1)/(G+S-1) = 1/5)" in out
    assert "IPU 1 · stage 1 · cpu: utilisation" in out
    assert out.rstrip().endswith(f"report: {reports['pipelined'].resolve() / 'report.html'}")


def test_compare_shows_throughput_and_idle_differences(reports, tmp_path, capsys):
    a, b = reports["sharded"], reports["pipelined"]
    assert cli(["report", "compare", str(a), str(b), "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    sa, sb = load(a)[0], load(b)[0]
    ta, tb = sa["throughput"]["items_per_second"], sb["throughput"]["items_per_second"]
    assert re.search(rf"performance: throughput +{ta:.1f} items/s +{tb:.1f} items/s +"
                     rf"\+{tb - ta:.1f} items/s \(\+{100 * (tb - ta) / ta:.1f}%\)", out)
    assert re.search(r"performance: bubble \(measured\) +50.0% +20.0% +-30.0 pts", out)
    assert re.search(r"settings: schedule +sharded +pipelined +changed", out)
    assert re.search(r"settings: gradient_accumulation +4 +4 +same", out)
    idle_a = sa["timing"]["per_device"][0]["idle_ms"] / sa["timing"]["calls_analysed"]
    idle_b = sb["timing"]["per_device"][0]["idle_ms"] / sb["timing"]["calls_analysed"]
    assert re.search(rf"device 0: idle per call +{idle_a:.2f} ms +{idle_b:.2f} ms +"
                     rf"-{idle_a - idle_b:.2f} ms", out)
    assert re.search(r"memory 0: activations \(stashed\) +- +- +same", out)  # no sample
    page = (tmp_path / "compare.html").read_text()
    assert out.rstrip().endswith(f"compare: {(tmp_path / 'compare.html').resolve()}")
    assert page.count('<svg class="timeline"') == 2 and "tr class=changed" in page


def test_compare_rows_are_b_minus_a(reports):
    table = rows(load(reports["sharded"]), load(reports["pipelined"]))
    by_name = {f"{r.section}: {r.name}": r for r in table}
    bubble = by_name["performance: bubble (theoretical)"]
    assert (bubble.a, bubble.b) == (pytest.approx(0.5), pytest.approx(0.2))
    assert Row("s", "n", 4, 6, str).difference() == "+2 (+50.0%)"
    assert Row("s", "n", 4, 4, str).difference() == "same"
    assert Row("s", "n", "x", None, str).difference() == "changed"


def test_cli_errors(reports, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli(["report", "compare", str(reports["sharded"])])
    assert "`report compare` takes two report directories, got 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["report", str(reports["sharded"]), str(reports["pipelined"])])
    assert "to compare two use `pipetorch report compare A B`" in capsys.readouterr().err
    assert cli(["report", str(tmp_path)]) == 2
    assert "has no summary.json: it is not a pipetorch report" in capsys.readouterr().err


def test_report_html_is_self_contained_with_a_lane_per_device(reports):
    page = (reports["pipelined"] / "report.html").read_text()
    assert page.count('<g class="lane device"') == 2 and page.count('<g class="lane host"') == 1
    assert 'data-device="1-0"' in page and 'data-device="2-1"' in page
    assert not re.search(r"(src|href)=\"(?!data:)|https?://|@import|url\(", page)
    # The last call's 8 forwards and 8 backwards per device, each labelled with its number.
    for mb in range(8):
        assert page.count(f'<rect class="span forward" data-mb="{mb}"') == 2
        assert page.count(f'<rect class="span backward" data-mb="{mb}"') == 2
    assert "measured <b>20.0%</b>, theoretical 20.0%" in page


def test_local_report_through_the_cli(tmp_path, capsys):
    compiled = local_compiled()
    profiler = Profiler(tmp_path, compiled, training=True, options=options())
    run_calls(profiler, compiled, calls=1, items=4)
    profiler.write()
    assert cli(["report", str(tmp_path)]) == 0
    assert "Only host calls were recorded: per-stage spans need the stages on several devices" \
        in capsys.readouterr().out


def test_report_runs_through_the_pipetorch_command(reports, capsys):
    from pipetorch.cli import main

    assert main.main(["report", str(reports["sharded"])]) == 0
    assert "sharded schedule" in capsys.readouterr().out
