// The tools' command lines, set up and answered one way (CLI11):
// gpuslice-agent, gpuslice-smi, gpuslice-cdi, gpuslice-bench,
// gpuslice-microbench and agent-cycle-bench.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>

namespace gpuslice::tools {

inline constexpr int kExitUsage = 64;  // EX_USAGE: a node tool's bad command line

// --version, printing the project's version (PROJECT_VERSION of this build).
void add_version_flag(CLI::App& app);

// How a bad command line ends a tool.
enum class BadCommandLine {
  usage_line,  // node tools: "<name>: <why> (see --help)" on stderr, status kExitUsage
  cli11,       // benchmarks: CLI11's own message and status
};

// Parses argv, then runs `checks` (a check that fails throws a CLI::ParseError
// naming its flag, e.g. CLI::ValidationError("--only", why)); both are answered
// alike. Returns std::nullopt to go on, else the status to exit with: 0 after
// --help or --version (printed on stdout), or as `bad` says.
std::optional<int> parse(CLI::App& app, int argc, char** argv, BadCommandLine bad = BadCommandLine::usage_line,
                         const std::function<void()>& checks = {});

// A node tool's refusal of a command line that parsed:
// "<app's name>: <message> (see --help)" on stderr. Returns kExitUsage.
int usage_error(const CLI::App& app, const std::string& message);

}  // namespace gpuslice::tools
