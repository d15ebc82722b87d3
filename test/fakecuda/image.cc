// Module images as the driver receives them (cuModuleLoadData and friends,
// cuLibraryLoadData, the linker): NUL-terminated PTX text, a cubin (ELF), a
// fatbin, or the __fatBinC_Wrapper_t that points at a fatbin. Binary images
// are not C strings: their size comes from their headers (ELF: the section and
// program header tables and every section's extent, <elf.h>; fatbin: the
// header's size fields; wrapper: fatbinary_section.h). Fatbin entries
// compressed by nvcc/fatbinary are not decompressed: a fatbin whose every code
// entry is compressed is "opaque" and accepts any kernel name (README "Modules").
//
// Simulated kernel durations also live here: spin_<N>us runs N us; any other
// kernel runs FAKECUDA_KERNEL_US's value for its name, else its "*" default,
// else 0.
#include <elf.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "driver.h"

namespace gpuslice::fakecuda {

namespace {

constexpr std::uint32_t kFatbinMagic = 0xBA55ED50u;
constexpr std::uint32_t kFatbinWrapperMagic = 0x466243B1u;   // FATBINC_MAGIC, fatbinary_section.h
constexpr std::uint64_t kMaxImage = std::uint64_t{1} << 32;  // sanity bound on header-derived sizes

struct FatbinHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t header_size;
  std::uint64_t fat_size;  // bytes of entries after the header
};
// One entry of a fatbin (layout as written by NVIDIA's fatbinary tool).
struct FatbinEntry {
  std::uint16_t kind;  // 1 PTX, 2 ELF (cubin), 4/8 LTO-IR and others
  std::uint16_t unknown;
  std::uint32_t header_size;
  std::uint64_t size;  // payload bytes after the entry header
  std::uint32_t compressed_size;
  std::uint32_t reserved0;
  std::uint16_t minor;
  std::uint16_t major;
  std::uint32_t arch;
  std::uint32_t name_offset;
  std::uint32_t name_size;
  std::uint64_t flags;
  std::uint64_t reserved1;
  std::uint64_t uncompressed_size;
};
constexpr std::uint64_t kEntryCompressed = 0x2000;      // LZ4 payload
constexpr std::uint64_t kEntryCompressedZstd = 0x8000;  // ZSTD payload (CUDA 12.8+)

// 0 when the image is not a well-formed ELF64 within `limit` bytes.
std::uint64_t elf_size(const unsigned char* p, std::uint64_t limit) {
  if (limit < sizeof(Elf64_Ehdr)) return 0;
  Elf64_Ehdr eh;
  std::memcpy(&eh, p, sizeof(eh));
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) return 0;  // cubins are ELF64
  std::uint64_t end = eh.e_ehsize;
  if (eh.e_phnum != 0) end = std::max<std::uint64_t>(end, eh.e_phoff + std::uint64_t{eh.e_phnum} * eh.e_phentsize);
  if (eh.e_shnum != 0) {
    if (eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shoff > kMaxImage) return 0;
    end = std::max<std::uint64_t>(end, eh.e_shoff + std::uint64_t{eh.e_shnum} * sizeof(Elf64_Shdr));
    if (end > limit) return 0;  // the section headers lie past the bytes given
    for (unsigned i = 0; i < eh.e_shnum; ++i) {
      Elf64_Shdr sh;
      std::memcpy(&sh, p + eh.e_shoff + i * sizeof(Elf64_Shdr), sizeof(sh));
      if (sh.sh_type != SHT_NOBITS) end = std::max<std::uint64_t>(end, sh.sh_offset + sh.sh_size);
    }
  }
  return end <= kMaxImage && end <= limit ? end : 0;
}

// Marks `opaque` when the fatbin's names cannot be read: some entry is
// compressed and no PTX or cubin entry is stored plainly (fatbinary compresses
// PTX by default but stores cubins plainly; their kernel names are the same).
void scan_fatbin(const unsigned char* p, std::uint64_t size, bool* opaque) {
  FatbinHeader h;
  std::memcpy(&h, p, sizeof(h));
  std::uint64_t at = h.header_size;
  bool compressed = false;
  bool readable = false;
  while (at + sizeof(FatbinEntry) <= size) {
    FatbinEntry e;
    std::memcpy(&e, p + at, sizeof(e));
    if (e.header_size < sizeof(FatbinEntry) || e.size > size) break;
    if ((e.flags & (kEntryCompressed | kEntryCompressedZstd)) != 0 || e.compressed_size != 0) {
      compressed = true;
    } else if (e.kind == 1 || e.kind == 2) {
      readable = true;
    }
    at += e.header_size + e.size;
  }
  *opaque = compressed && !readable;
}

struct Durations {
  std::map<std::string, std::uint64_t> by_name;  // ns
  std::uint64_t fallback = 0;
  CUresult status = CUDA_SUCCESS;
};

Durations parse_durations() {
  Durations d;
  const char* env = std::getenv("FAKECUDA_KERNEL_US");
  if (env == nullptr || *env == '\0') return d;
  std::string text(env);
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::size_t eq = item.rfind('=');
    char* end = nullptr;
    const char* value = eq == std::string::npos ? "" : item.c_str() + eq + 1;
    unsigned long long us = std::strtoull(value, &end, 10);
    if (eq == std::string::npos || eq == 0 || *value < '0' || *value > '9' || *end != '\0' || us > 3600000000ull) {
      std::fprintf(stderr,
                   "fakecuda: FAKECUDA_KERNEL_US='%s': expected name=microseconds[,name=microseconds...] "
                   "(0-3600000000; name * sets the default)\n",
                   env);
      d.status = CUDA_ERROR_INVALID_VALUE;
      return d;
    }
    std::string name = item.substr(0, eq);
    if (name == "*") {
      d.fallback = us * 1000ull;
    } else {
      d.by_name[name] = us * 1000ull;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return d;
}

const Durations& durations() {
  static const Durations d = parse_durations();  // read once per process
  return d;
}

std::uint64_t spin_duration_ns(const char* name) {
  unsigned long long micros = 0;
  int consumed = 0;
  if (std::strncmp(name, "spin_", 5) != 0 || name[5] < '0' || name[5] > '9') return ~std::uint64_t{0};
  if (std::sscanf(name, "spin_%lluus%n", &micros, &consumed) != 1) return ~std::uint64_t{0};
  if (consumed <= 0 || name[consumed] != '\0') return ~std::uint64_t{0};
  return micros * 1000ull;
}

}  // namespace

// Compares byte by byte, so a shorter NUL-terminated text is never read past
// its terminator (no magic number here contains a zero byte).
bool has_magic(const unsigned char* p, std::uint32_t magic) {
  for (int i = 0; i < 4; ++i) {
    if (p[i] != ((magic >> (8 * i)) & 0xFF)) return false;
  }
  return true;
}

CUresult read_image(const void* image, std::string* bytes, bool* opaque, std::uint64_t limit) {
  *opaque = false;
  if (CUresult rc = durations().status; rc != CUDA_SUCCESS) return rc;
  const auto* p = static_cast<const unsigned char*>(image);
  std::uint32_t magic = 0;
  if (has_magic(p, kFatbinWrapperMagic)) magic = kFatbinWrapperMagic;
  if (has_magic(p, kFatbinMagic)) magic = kFatbinMagic;
  if (magic == kFatbinWrapperMagic) {
    const unsigned long long* data = nullptr;
    std::memcpy(&data, p + 8, sizeof(data));  // __fatBinC_Wrapper_t::data
    if (data == nullptr) return CUDA_ERROR_INVALID_IMAGE;
    p = reinterpret_cast<const unsigned char*>(data);
    if (!has_magic(p, kFatbinMagic)) return CUDA_ERROR_INVALID_IMAGE;
    magic = kFatbinMagic;
  }
  if (magic == kFatbinMagic) {
    FatbinHeader h;
    std::memcpy(&h, p, sizeof(h));
    if (h.header_size < sizeof(h) || h.fat_size > kMaxImage) return CUDA_ERROR_INVALID_IMAGE;
    if (h.header_size + h.fat_size > limit) return CUDA_ERROR_INVALID_IMAGE;
    bytes->assign(reinterpret_cast<const char*>(p), h.header_size + h.fat_size);
    scan_fatbin(p, bytes->size(), opaque);
    return CUDA_SUCCESS;
  }
  if (has_magic(p, 0x464C457Fu)) {  // ELFMAG
    std::uint64_t size = elf_size(p, limit);
    if (size == 0) return CUDA_ERROR_INVALID_IMAGE;
    bytes->assign(reinterpret_cast<const char*>(p), size);
    return CUDA_SUCCESS;
  }
  bytes->assign(reinterpret_cast<const char*>(p));  // PTX: NUL-terminated text
  return bytes->empty() ? CUDA_ERROR_INVALID_IMAGE : CUDA_SUCCESS;
}

void fatbin_append_entry(std::string* out, std::uint16_t kind, const std::string& payload, bool opaque) {
  if (out->empty()) {
    FatbinHeader h{kFatbinMagic, 1, sizeof(FatbinHeader), 0};
    out->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  FatbinEntry e{};
  e.kind = kind;
  e.header_size = sizeof(FatbinEntry);
  e.size = (payload.size() + 8) / 8 * 8;  // NUL-terminated, 8-byte aligned
  e.flags = opaque ? kEntryCompressed : 0;
  e.arch = 90;
  out->append(reinterpret_cast<const char*>(&e), sizeof(e));
  out->append(payload);
  out->append(e.size - payload.size(), '\0');
  FatbinHeader h;
  std::memcpy(&h, out->data(), sizeof(h));
  h.fat_size = out->size() - sizeof(FatbinHeader);
  std::memcpy(out->data(), &h, sizeof(h));
}

std::uint64_t kernel_duration_ns(const std::string& name) {
  if (std::uint64_t spin = spin_duration_ns(name.c_str()); spin != ~std::uint64_t{0}) return spin;
  const Durations& d = durations();
  auto it = d.by_name.find(name);
  return it != d.by_name.end() ? it->second : d.fallback;
}

}  // namespace gpuslice::fakecuda
