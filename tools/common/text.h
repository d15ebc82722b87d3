// Untrusted text shown by the node tools, and the names they write.
//
// Names read from files a container controls (region file names, directory
// names, the container name in a region's header) may hold any bytes. Every
// place a tool shows one (the agent's log, /metrics labels, /api/status,
// gpuslice-smi's table, JSON and messages) shows escape_untrusted() of it:
// printable ASCII (0x20-0x7e) is kept, every other byte and '\' become \xNN.
// The result is one line of ASCII (valid UTF-8, a valid JSON string, a valid
// Prometheus label value once escape_label'd), and the mapping is injective:
// two different names never show alike, so a name stays traceable.
//
// valid_name() is the one rule for the names gpuslice-cdi writes (the region
// file's name, the container name, the slice's directory): they go into the
// environment, the configuration file and the spec, and each of those must
// read back the same bytes. A valid name is its own escape_untrusted().
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace gpuslice::tools {

// Writes the escaped form of in[0, n) into out (at most cap - 1 bytes, then a
// NUL; an escape is never cut in half). Returns the bytes written. No heap:
// the agent's log uses it.
std::size_t escape_untrusted_to(const char* in, std::size_t n, char* out, std::size_t cap) noexcept;
std::string escape_untrusted(std::string_view raw);

// What a name gpuslice-cdi writes may hold: 1 to max_bytes printable ASCII
// characters other than '/' and '\', no blank at either end, not "." or "..".
// false + why: "<what> '<name as escaped>': <what is wrong>, expected ...".
bool valid_name(std::string_view name, std::size_t max_bytes, const char* what, std::string* why);

}  // namespace gpuslice::tools
