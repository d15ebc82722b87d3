#include "cli.h"

#include <cstdio>

#ifndef GPUSLICE_VERSION
#define GPUSLICE_VERSION "unknown"
#endif

namespace gpuslice::tools {

void add_version_flag(CLI::App& app) { app.set_version_flag("--version", GPUSLICE_VERSION); }

std::optional<int> parse(CLI::App& app, int argc, char** argv, BadCommandLine bad,
                         const std::function<void()>& checks) {
  try {
    app.parse(argc, argv);
    if (checks) checks();
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (bad == BadCommandLine::cli11) return app.exit(e);
    return usage_error(app, e.what());
  }
  return std::nullopt;
}

int usage_error(const CLI::App& app, const std::string& message) {
  std::fprintf(stderr, "%s: %s (see --help)\n", app.get_name().c_str(), message.c_str());
  return kExitUsage;
}

}  // namespace gpuslice::tools
