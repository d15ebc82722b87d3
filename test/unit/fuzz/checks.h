// Invariants the fuzz targets share: text that leaves a tool (UTF-8, the
// Prometheus text format, log lines) and the option values two parsers agree
// on. Each returns "" when the invariant holds, else what is wrong.
#pragma once

#include <cstddef>
#include <string>

#include "limiter/options/options.h"

// Checks of issue 33's hostile names (the fixes: tools/common/text.h, the
// agent's log, gpuslice-cdi's valid_name). On by default; 0 turns one off, to
// see what the code did before its fix:
//   GPUSLICE_FUZZ_CHECK_UTF8_NAMES      /metrics label values are UTF-8, /api/status
//                                       and gpuslice-smi --json render (no exception)
//   GPUSLICE_FUZZ_CHECK_LOG_LINES       every line the agent logs is its own line
//                                       ("gpuslice: " first), also smi's skip messages
//   GPUSLICE_FUZZ_CHECK_TABLE_TEXT      gpuslice-smi's table holds no control bytes
//   GPUSLICE_FUZZ_CHECK_CDI_ROUNDTRIP   gpuslice-cdi's configuration file reads back
//                                       as the values of the spec's environment
#ifndef GPUSLICE_FUZZ_CHECK_UTF8_NAMES
#define GPUSLICE_FUZZ_CHECK_UTF8_NAMES 1
#endif
#ifndef GPUSLICE_FUZZ_CHECK_LOG_LINES
#define GPUSLICE_FUZZ_CHECK_LOG_LINES 1
#endif
#ifndef GPUSLICE_FUZZ_CHECK_TABLE_TEXT
#define GPUSLICE_FUZZ_CHECK_TABLE_TEXT 1
#endif
#ifndef GPUSLICE_FUZZ_CHECK_CDI_ROUNDTRIP
#define GPUSLICE_FUZZ_CHECK_CDI_ROUNDTRIP 1
#endif

namespace gpuslice::fuzz {

bool valid_utf8(const std::string& s);

// Prometheus text format 0.0.4 as a scraper reads it: every line ends in
// '\n' and is "# HELP/TYPE ...", or name{label="value",...} value, with label
// values escaped (only \\, \" and \n) and, if utf8, valid UTF-8.
// *samples: the number of sample lines.
std::string check_exposition(const std::string& text, bool utf8, std::size_t* samples);

// Every line of `log` starts with `prefix` and the text ends with '\n' (or is empty).
std::string check_lines(const std::string& log, const char* prefix);

// The first option whose value differs ("" if none); sources are not compared,
// nor GPUSLICE_CONFIG_FILE (which file was read).
std::string differing_option(const options::Options& a, const options::Options& b);

// Runs with stderr (fd 2) redirected into memory; the text written. fail()
// still reports on the real stderr. GPUSLICE_FUZZ_SHOW_STDERR=1: no capture.
class StderrCapture {
 public:
  StderrCapture();
  ~StderrCapture();
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  std::string finish();  // restores stderr; what was written meanwhile

 private:
  int memfd_ = -1;
  int saved_ = -1;
};

// The real stderr while a capture runs (else 2).
int report_fd();

// fail() runs `cleanup` before it aborts (a target's temporary files).
void on_fail(void (*cleanup)());
void run_fail_cleanup();

}  // namespace gpuslice::fuzz
