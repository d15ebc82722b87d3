// Whether a directory is still in use by a container: the runtime binds a
// pod's region directory into the container's mount namespace (and the
// kubelet, for a subPath, into the host's), so a directory some mount
// namespace of the node has mounted (it, or a directory below it, as a
// mount's source) can still be written by a container and must stay.
//
// The directory's file system and path inside it come from our own mount
// table; every mount namespace (one /proc/<pid>/mountinfo per distinct
// /proc/<pid>/ns/mnt) is then searched for a mount of the same file system
// whose root is that path or below it. Anything that cannot be known (the
// directory's file system not found in our table, a namespace we may not
// read) counts as mounted: a directory is kept rather than removed.
#pragma once

#include <string>
#include <vector>

namespace gpuslice::agent {

// One answer per directory (absolute paths as this process sees them).
// Costs a readlink per process of /proc and one mountinfo read per mount
// namespace: call it rarely, for every directory at once.
std::vector<bool> mounted_somewhere(const std::vector<std::string>& dirs, const std::string& proc = "/proc");

// A mountinfo path field with its octal escapes (\040 ...) decoded.
std::string mountinfo_unescape(const std::string& field);

}  // namespace gpuslice::agent
