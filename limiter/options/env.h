// Scanning the environment for gpuslice's options and their aliases (part of
// the option parser, limiter/options/options.cc): which variable set what,
// without parsing values yet.
#pragma once

#include <cstddef>

#include "gpuslice/options.h"
#include "limiter/options/options.h"

namespace gpuslice::options::env {

struct Found {
  const char* ours[kOptionCount];
  const char* alias[kOptionAliasCount];  // the global (or only) form
  const char* alias_device[kOptionAliasCount][kMaxDevices];
  const char* alias_device_name[kOptionAliasCount][kMaxDevices];
};

// Records every option and alias assignment of envp (the first of duplicates
// wins, as with getenv) and the first unknown GPUSLICE_* name. False (err set)
// for a per-device alias with a malformed index.
bool collect(char* const* envp, Found* f, Options* out, shm::Error* err);
// "CUDA_DEVICE_MEMORY_LIMIT_3" from the entry "CUDA_DEVICE_MEMORY_LIMIT_3=..."
void name_of(const char* entry, char* buf, std::size_t cap);

// What the name of the entry "NAME=VALUE" is.
enum class Name { option, alias, bad_device_index, unknown };
Name classify(const char* entry);
// A scalar alias's map ("key=word,...", gpuslice/options.h) applied to
// `value`: the first key that matches gives the word (`*word`, `*n`; n == 0:
// "not set"). Keys: a word (any case); `N+`, any decimal integer >= N; `-`,
// any negative integer; `*`, anything else (*fallback: a value HAMi gives no
// meaning we can keep, worth a warning). False: no key matches.
bool match_alias(const char* map, const char* value, const char** word, std::size_t* n, bool* fallback);
// The key list of a map for a message: "0, 1, 2, 3, 4 and above".
void list_alias_keys(const char* map, char* buf, std::size_t cap);

// Whether option k is set in f by any of its names (ours, an alias, any
// per-device form of one).
bool sets(const Found& f, std::size_t k);
// Moves every name of option k from `from` into `to`.
void take(Found* to, const Found& from, std::size_t k);

}  // namespace gpuslice::options::env

namespace gpuslice::options {
// Resolves the options from what collect found (options.cc): defaults, then
// values, with errors as parse_options reports them.
bool resolve_found(const env::Found& f, Options* out, shm::Error* err) noexcept;

}  // namespace gpuslice::options
