// Virtual memory management: physical allocations (cuMemCreate) are charged to
// their device from creation until they are both released and unmapped
// everywhere, as the driver documents; address reservations cost nothing.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

constexpr std::uint64_t kGranularity = std::uint64_t{2} << 20;
// VMM reservations live above every device's cuMemAlloc window.
constexpr std::uint64_t kVaBase = std::uint64_t{1} << 49;

struct Physical {
  std::uint32_t device = 0;
  std::uint64_t size = 0;
  int references = 1;  // cuMemCreate + cuMemRetainAllocationHandle - cuMemRelease
  int mappings = 0;
  bool charged = true;  // false: host-located, or imported from another process
  CUmemAllocationProp prop{};
  void* bytes = nullptr;  // contents, mapped at first access (bytes.cc); shared by all its mappings
  // Shareable (POSIX fd requested) and imported allocations keep their bytes
  // in a memfd, which is what an export hands out: importers in other
  // processes map the same pages. Its last sizeof(ExportRecord) bytes, past
  // the contents, describe the allocation.
  int fd = -1;
};

// What an exported POSIX file descriptor (the allocation's memfd) carries
// after the contents: enough for an importer to find the allocation again.
struct ExportRecord {
  std::uint64_t magic;
  std::uint32_t exporter_pid;
  std::uint32_t device;
  std::uint64_t handle;
  std::uint64_t size;
  CUmemAllocationProp prop;
};
constexpr std::uint64_t kExportMagic = 0x54524f50584b4146ull;  // "FAKXPORT"
struct Mapping {
  std::uint64_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  std::uint64_t offset = 0;  // into the physical allocation
};

// All under the runtime mutex.
std::map<CUmemGenericAllocationHandle, Physical> g_physical;
std::map<CUdeviceptr, std::uint64_t> g_reservations;  // base -> size
std::map<CUdeviceptr, Mapping> g_mappings;            // base -> mapping
CUmemGenericAllocationHandle g_next_handle = 0x7000;
std::uint64_t g_next_va = kVaBase;

bool host_located(const CUmemAllocationProp& prop) {
  return prop.location.type == CU_MEM_LOCATION_TYPE_HOST || prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
}

// Device memory, or pinned host memory (CU_MEM_LOCATION_TYPE_HOST[_NUMA], CUDA
// 12.2+), which holds no device memory.
bool valid_prop(const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return false;
  if (prop->location.type == CU_MEM_LOCATION_TYPE_HOST) return true;
  if (prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) return prop->location.id >= 0;
  return prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && valid_device(prop->location.id);
}

bool shareable(const Physical& physical) {
  return (physical.prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
}

// The memfd holding a shareable allocation's bytes (sparse: costs nothing until touched).
int content_fd_locked(Physical& physical) {
  if (physical.fd >= 0) return physical.fd;
  int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(physical.size + sizeof(ExportRecord))) != 0) {
    close(fd);
    return -1;
  }
  physical.fd = fd;
  return fd;
}

void drop_if_unused_locked(std::map<CUmemGenericAllocationHandle, Physical>::iterator it) {
  if (it->second.references == 0 && it->second.mappings == 0) {
    if (it->second.charged) uncharge_device(it->second.device, it->second.size);
    if (it->second.bytes != nullptr) munmap(it->second.bytes, it->second.size);
    if (it->second.fd >= 0) close(it->second.fd);
    g_physical.erase(it);
  }
}

bool inside_reservation_locked(CUdeviceptr ptr, std::uint64_t size) {
  auto it = g_reservations.upper_bound(ptr);
  if (it == g_reservations.begin()) return false;
  --it;
  return ptr >= it->first && ptr + size <= it->first + it->second;
}

bool overlaps_mapping_locked(CUdeviceptr ptr, std::uint64_t size) {
  auto it = g_mappings.lower_bound(ptr);
  if (it != g_mappings.end() && it->first < ptr + size) return true;
  if (it != g_mappings.begin()) {
    --it;
    if (it->first + it->second.size > ptr) return true;
  }
  return false;
}

}  // namespace

namespace gpuslice::fakecuda {

bool vmm_find_mapping_locked(CUdeviceptr ptr, CUdeviceptr* base, std::uint64_t* size) {
  auto it = g_mappings.upper_bound(ptr);
  if (it == g_mappings.begin()) return false;
  --it;
  if (ptr - it->first >= it->second.size) return false;
  *base = it->first;
  *size = it->second.size;
  return true;
}

CUresult vmm_bytes_locked(CUdeviceptr ptr, std::uint64_t len, unsigned char** out) {
  CUdeviceptr base = 0;
  std::uint64_t size = 0;
  if (!vmm_find_mapping_locked(ptr, &base, &size)) return CUDA_ERROR_NOT_FOUND;
  if (len > size - (ptr - base)) return CUDA_ERROR_INVALID_VALUE;  // mappings are not stitched together
  const Mapping& mapping = g_mappings[base];
  Physical& physical = g_physical[mapping.handle];
  if (physical.bytes == nullptr) {
    void* p = MAP_FAILED;
    if (shareable(physical) || physical.fd >= 0) {
      int fd = content_fd_locked(physical);
      if (fd >= 0) p = mmap(nullptr, physical.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    } else {
      p = mmap(nullptr, physical.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    }
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    physical.bytes = p;
  }
  *out = static_cast<unsigned char*>(physical.bytes) + mapping.offset + (ptr - base);
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                  CUmemAllocationGranularity_flags option) {
  if (granularity == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                                unsigned long long flags) {
  if (handle == nullptr || prop == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard guard(runtime().mu);
  const bool host = host_located(*prop);
  auto dev = host ? 0u : physical_device(prop->location.id);
  if (!host) {
    if (CUresult rc = charge_device(dev, size); rc != CUDA_SUCCESS) return rc;
  }
  Physical physical;
  physical.device = dev;
  physical.size = size;
  physical.charged = !host;
  physical.prop = *prop;
  CUmemGenericAllocationHandle id = g_next_handle++;
  g_physical[id] = physical;
  *handle = id;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  auto it = g_physical.find(handle);
  if (it == g_physical.end() || it->second.references == 0) return CUDA_ERROR_INVALID_VALUE;
  --it->second.references;
  drop_if_unused_locked(it);  // still mapped somewhere: memory stays held until unmapped
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  CUdeviceptr base = 0;
  std::uint64_t size = 0;
  if (!vmm_find_mapping_locked(reinterpret_cast<CUdeviceptr>(addr), &base, &size)) return CUDA_ERROR_INVALID_VALUE;
  CUmemGenericAllocationHandle id = g_mappings[base].handle;
  ++g_physical[id].references;
  *handle = id;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                           CUmemGenericAllocationHandle handle) {
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  auto it = g_physical.find(handle);
  if (it == g_physical.end()) return CUDA_ERROR_INVALID_VALUE;
  *prop = it->second.prop;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
  (void)addr;  // a hint the driver may ignore; so does the fake
  if (ptr == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment != 0 && (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard guard(runtime().mu);
  std::uint64_t align = std::max<std::uint64_t>(alignment, kGranularity);
  std::uint64_t base = (g_next_va + align - 1) / align * align;
  // Leave a granule of guard space between reservations.
  g_next_va = base + size + kGranularity;
  g_reservations[base] = size;
  *ptr = base;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  auto it = g_reservations.find(ptr);
  if (it == g_reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  // The range must be unmapped first: freeing it would strand the mappings' memory.
  if (overlaps_mapping_locked(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  g_reservations.erase(it);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
  if (flags != 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (size % kGranularity != 0 || offset % kGranularity != 0 || ptr % kGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard guard(runtime().mu);
  auto it = g_physical.find(handle);
  if (it == g_physical.end() || it->second.references == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (offset + size > it->second.size) return CUDA_ERROR_INVALID_VALUE;
  if (!inside_reservation_locked(ptr, size) || overlaps_mapping_locked(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  ++it->second.mappings;
  g_mappings[ptr] = Mapping{size, handle, offset};
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  // The range must cover whole mappings: a partial unmap is an error.
  auto first = g_mappings.lower_bound(ptr);
  if (first != g_mappings.begin()) {
    auto before = std::prev(first);
    if (before->first + before->second.size > ptr) return CUDA_ERROR_INVALID_VALUE;
  }
  auto last = first;
  while (last != g_mappings.end() && last->first < ptr + size) {
    if (last->first + last->second.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    ++last;
  }
  if (first == last) return CUDA_ERROR_INVALID_VALUE;
  for (auto it = first; it != last;) {
    auto physical = g_physical.find(it->second.handle);
    --physical->second.mappings;
    drop_if_unused_locked(physical);
    it = g_mappings.erase(it);
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(desc[i].location.id)) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  std::lock_guard guard(runtime().mu);
  // Every byte of the range must be mapped.
  CUdeviceptr cursor = ptr;
  while (cursor < ptr + size) {
    CUdeviceptr base = 0;
    std::uint64_t length = 0;
    if (!vmm_find_mapping_locked(cursor, &base, &length)) return CUDA_ERROR_INVALID_VALUE;
    cursor = base + length;
  }
  return CUDA_SUCCESS;
}

// Export as a POSIX file descriptor (the only handle type modelled), allowed
// only if the allocation asked for it in requestedHandleTypes.
extern "C" CUresult cuMemExportToShareableHandle(void* shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
  if (shareableHandle == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  std::lock_guard guard(runtime().mu);
  auto it = g_physical.find(handle);
  if (it == g_physical.end() || it->second.references == 0) return CUDA_ERROR_INVALID_VALUE;
  if ((it->second.prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  ExportRecord record{kExportMagic,   static_cast<std::uint32_t>(getpid()), it->second.device, handle, it->second.size,
                      it->second.prop};
  int content = content_fd_locked(it->second);
  if (content < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  if (pwrite(content, &record, sizeof(record), static_cast<off_t>(it->second.size)) !=
      static_cast<ssize_t>(sizeof(record))) {
    return CUDA_ERROR_OPERATING_SYSTEM;
  }
  int fd = fcntl(content, F_DUPFD_CLOEXEC, 0);  // the caller owns (and may close) its own descriptor
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  *static_cast<int*>(shareableHandle) = fd;
  return CUDA_SUCCESS;
}

// Import: in the exporting process, the same allocation with one more
// reference (as cuMemRetainAllocationHandle); in another process, a new handle
// to the same memory, which stays charged to the exporter only.
extern "C" CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* osHandle,
                                                   CUmemAllocationHandleType shHandleType) {
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(osHandle));
  ExportRecord record{};
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(record)) ||
      pread(fd, &record, sizeof(record), st.st_size - static_cast<off_t>(sizeof(record))) !=
          static_cast<ssize_t>(sizeof(record)) ||
      record.magic != kExportMagic) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard guard(runtime().mu);
  if (record.exporter_pid == static_cast<std::uint32_t>(getpid())) {
    auto it = g_physical.find(record.handle);
    if (it == g_physical.end()) return CUDA_ERROR_INVALID_VALUE;
    ++it->second.references;
    *handle = record.handle;
    return CUDA_SUCCESS;
  }
  Physical physical;
  physical.device = record.device;
  physical.size = record.size;
  physical.charged = false;
  physical.prop = record.prop;
  physical.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the same pages as the exporter's
  if (physical.fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  CUmemGenericAllocationHandle id = g_next_handle++;
  g_physical[id] = physical;
  *handle = id;
  return CUDA_SUCCESS;
}
