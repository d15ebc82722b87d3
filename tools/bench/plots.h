// gpuslice-bench --plots: SVG plots of a JSON report, drawn by the plotting
// script installed next to the executable (tools/bench/plot.py, copied to
// <bin>/gpuslice-bench-plot.py) with matplotlib, run by the Python of the
// build's venv (<build>/venv/bin/python, made by tools/setup.sh) or
// $GPUSLICE_BENCH_PYTHON. The bench itself needs neither.
#pragma once

#include <string>

namespace gpuslice::bench {

// Writes the plots of the report at report_path into dir (created if
// needed). False, with one line on stderr naming what is missing (the
// Python, the script, matplotlib) or what failed.
bool write_plots(const std::string& report_path, const std::string& dir, bool quiet);

}  // namespace gpuslice::bench
