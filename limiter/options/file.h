// The configuration file: options for every process of a container, including
// those that clear their environment (env -i, sudo, a launcher that sanitises
// it) and would otherwise run unlimited with a region of their own.
//
// Precedence, option by option: the environment, then the file, then the
// default. An option counts as set by the environment when any of its names
// is there (GPUSLICE_* or a HAMi alias, any per-device form); the file's lines
// for that option are then ignored, whatever they say.
//
// Which file: GPUSLICE_CONFIG_FILE from the environment if set (only the
// environment can name it), else the default /etc/gpuslice/gpuslice.conf. A
// missing default file is no error (nothing configured there); a named file
// that cannot be read, an unreadable default file, or anything malformed is
// an error, and the library fails closed as for a malformed quota.
//
// Format: one `NAME=VALUE` per line, with the names and grammar of the
// environment (README option table), surrounding blanks (spaces, tabs, a CR)
// of the line, the name and the value ignored; `#` starts a comment line;
// blank lines are allowed. No quoting: the value is what follows `=`. Each
// name at most once. Anything else is an error that names the file, the line
// and what was expected. At most kConfigFileMaxBytes.
//
// Read with open/read into the caller's buffer: no heap, so that it runs in
// the preload library's bootstrap.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/options.h"
#include "limiter/options/options.h"
#include "shm/region_file.h"

namespace gpuslice::options {

inline constexpr char kDefaultConfigFile[] = "/etc/gpuslice/gpuslice.conf";
inline constexpr std::size_t kConfigFileMaxBytes = 64 * 1024;
// Every name at most once: the options, the aliases and their per-device forms.
inline constexpr std::size_t kConfigFileMaxEntries = kOptionCount + kOptionAliasCount * (1 + kMaxDevices);

// Storage for one read of the file (large: give it static storage).
struct ConfigFileBuffer {
  char path[4096];  // the file read
  char text[kConfigFileMaxBytes + 1];
  char* entries[kConfigFileMaxEntries + 1];  // "NAME=VALUE", NULL-terminated list
  std::uint32_t lines[kConfigFileMaxEntries];
  bool used[kConfigFileMaxEntries];  // the option was taken from the file
};

// The environment, then the configuration file (named by envp's
// GPUSLICE_CONFIG_FILE, else `default_file`: the library passes
// kDefaultConfigFile). Errors as parse_options; those of a value from the file
// read "gpuslice: FILE:LINE: NAME='value': ...". Each option's sources say
// whether the file set it (OptionSource::line).
bool load_options(char* const* envp, const char* default_file, ConfigFileBuffer* buf, Options* out,
                  shm::Error* err) noexcept;

}  // namespace gpuslice::options
