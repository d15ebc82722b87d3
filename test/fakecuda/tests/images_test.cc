// Module images: binary cubins and fatbins (not C strings), any kernel name,
// simulated durations from FAKECUDA_KERNEL_US, the JIT linker, kernel
// attributes and occupancy.
#include <elf.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "common.h"

using namespace fakecuda_test;

namespace {

// A minimal ELF64 "cubin": a null section, .text.<kernel> and .shstrtab. The
// bytes contain NULs right after the magic, as every real cubin does.
std::string MakeCubin(const std::string& kernel) {
  std::string strtab = std::string("\0.shstrtab\0.text.", 17) + kernel + std::string("\0", 1);
  Elf64_Ehdr eh{};
  std::memcpy(eh.e_ident, ELFMAG, SELFMAG);
  eh.e_ident[EI_CLASS] = ELFCLASS64;
  eh.e_ident[EI_DATA] = ELFDATA2LSB;
  eh.e_ident[EI_VERSION] = EV_CURRENT;
  eh.e_type = ET_EXEC;
  eh.e_machine = 190;  // EM_CUDA
  eh.e_version = EV_CURRENT;
  eh.e_ehsize = sizeof(Elf64_Ehdr);
  eh.e_shentsize = sizeof(Elf64_Shdr);
  eh.e_shnum = 3;
  eh.e_shstrndx = 1;
  const std::string code(16, '\x5a');
  const std::uint64_t strtab_at = sizeof(Elf64_Ehdr);
  const std::uint64_t code_at = strtab_at + strtab.size();
  eh.e_shoff = code_at + code.size();
  Elf64_Shdr sh[3]{};
  sh[1].sh_name = 1;
  sh[1].sh_type = SHT_STRTAB;
  sh[1].sh_offset = strtab_at;
  sh[1].sh_size = strtab.size();
  sh[2].sh_name = 11;
  sh[2].sh_type = SHT_PROGBITS;
  sh[2].sh_offset = code_at;
  sh[2].sh_size = code.size();
  std::string out(reinterpret_cast<const char*>(&eh), sizeof(eh));
  out += strtab + code;
  out.append(reinterpret_cast<const char*>(sh), sizeof(sh));
  return out;
}

// A fatbin (fatbinary_section.h's magic, NVIDIA's layout) with one entry.
std::string MakeFatbin(const std::string& payload, std::uint16_t kind, std::uint64_t flags) {
  struct Header {
    std::uint32_t magic;
    std::uint16_t version, header_size;
    std::uint64_t fat_size;
  };
  struct Entry {
    std::uint16_t kind, unknown;
    std::uint32_t header_size;
    std::uint64_t size;
    std::uint32_t compressed_size, reserved0;
    std::uint16_t minor, major;
    std::uint32_t arch, name_offset, name_size;
    std::uint64_t flags, reserved1, uncompressed_size;
  };
  std::string body = payload;
  body.resize((body.size() + 8) / 8 * 8, '\0');
  Entry e{kind, 0, sizeof(Entry), body.size(), 0, 0, 0, 0, 90, 0, 0, flags, 0, 0};
  Header h{0xBA55ED50u, 1, sizeof(Header), sizeof(Entry) + body.size()};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) +
         std::string(reinterpret_cast<const char*>(&e), sizeof(e)) + body;
}

TEST_F(FakeCuda, BinaryImagesAreNotCStrings) {
  InitWithContext();
  const std::string cubin = MakeCubin("saxpy_kernel");
  ASSERT_EQ(cubin[7], '\0');  // a C string would end here
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, cubin.data()));
  EXPECT_CU(cuModuleGetFunction(&f, module, "saxpy_kernel"));
  EXPECT_EQ(cuModuleGetFunction(&f, module, "other_kernel"), CUDA_ERROR_NOT_FOUND);
  ASSERT_CU(cuModuleUnload(module));
  // The same cubin inside a fatbin, directly and through the wrapper nvcc emits.
  const std::string fatbin = MakeFatbin(cubin, 2, 0);
  ASSERT_CU(cuModuleLoadFatBinary(&module, fatbin.data()));
  EXPECT_CU(cuModuleGetFunction(&f, module, "saxpy_kernel"));
  EXPECT_EQ(cuModuleGetFunction(&f, module, "other_kernel"), CUDA_ERROR_NOT_FOUND);
  struct {
    int magic, version;
    const unsigned long long* data;
    void* unused;
  } wrapper{0x466243B1, 1, reinterpret_cast<const unsigned long long*>(fatbin.data()), nullptr};
  CUlibrary library = nullptr;
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, &wrapper, nullptr, nullptr, 0, nullptr, nullptr, 0));
  EXPECT_CU(cuLibraryGetKernel(&kernel, library, "saxpy_kernel"));
  // A compressed entry cannot be read: every name is accepted (README).
  ASSERT_CU(cuModuleLoadData(&module, MakeFatbin(std::string(64, '\x11'), 2, 0x2000).data()));
  EXPECT_CU(cuModuleGetFunction(&f, module, "any_name_at_all"));
  // Garbage after an ELF magic is refused.
  std::string broken = cubin.substr(0, sizeof(Elf64_Ehdr));
  reinterpret_cast<Elf64_Ehdr*>(broken.data())->e_shentsize = 12;
  EXPECT_EQ(cuModuleLoadData(&module, broken.data()), CUDA_ERROR_INVALID_IMAGE);
  // A cubin cut short (a truncated file, or fewer bytes than it claims given
  // to the linker) is refused, never read past its end.
  const std::string path = dir_ + "/short.cubin";
  std::ofstream(path, std::ios::binary) << cubin.substr(0, cubin.size() - 8);
  EXPECT_EQ(cuModuleLoad(&module, path.c_str()), CUDA_ERROR_INVALID_IMAGE);
  EXPECT_EQ(cuLibraryLoadFromFile(&library, path.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0),
            CUDA_ERROR_INVALID_IMAGE);
  unlink(path.c_str());
  CUlinkState link = nullptr;
  ASSERT_CU(cuLinkCreate(0, nullptr, nullptr, &link));
  EXPECT_EQ(cuLinkAddData(link, CU_JIT_INPUT_CUBIN, const_cast<char*>(cubin.data()), cubin.size() - 8, "short", 0,
                          nullptr, nullptr),
            CUDA_ERROR_INVALID_IMAGE);
  ASSERT_CU(cuLinkDestroy(link));
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

// A real cubin and fatbins from the toolkit's ptxas and fatbinary, when the
// toolkit is here. fatbinary compresses PTX entries by default (not cubins);
// with --compress-all every entry is compressed and the module is opaque.
TEST_F(FakeCuda, CubinAndFatbinFromTheToolkit) {
  const std::string ptxas = FAKECUDA_PTXAS;
  const std::string fatbinary = ptxas.empty() ? "" : ptxas.substr(0, ptxas.rfind('/') + 1) + "fatbinary";
  if (ptxas.empty() || access(ptxas.c_str(), X_OK) != 0 || access(fatbinary.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "no ptxas/fatbinary in a CUDA toolkit here";
  }
  InitWithContext();
  const std::string ptx = dir_ + "/k.ptx", cubin = dir_ + "/k.cubin", fat = dir_ + "/k.fatbin",
                    packed = dir_ + "/packed.fatbin";
  std::ofstream(ptx) << ".version 8.0\n.target sm_90\n.address_size 64\n"
                        ".visible .entry scale_rows(.param .u64 p) { ret; }\n";
  const std::string images = " --image3=kind=elf,sm=90,file=" + cubin + " --image3=kind=ptx,sm=90,file=" + ptx;
  for (const std::string& cmd :
       {ptxas + " -arch=sm_90 " + ptx + " -o " + cubin, fatbinary + " --create=" + fat + images,
        fatbinary + " --compress-all --create=" + packed + images}) {
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  for (const std::string& path : {cubin, fat}) {
    const std::string bytes = ReadFile(path);
    CUmodule module = nullptr;
    CUfunction f = nullptr;
    ASSERT_CU(cuModuleLoadData(&module, bytes.data())) << path;
    EXPECT_CU(cuModuleGetFunction(&f, module, "scale_rows")) << path;
    EXPECT_EQ(cuModuleGetFunction(&f, module, "scale_cols"), CUDA_ERROR_NOT_FOUND) << path;
  }
  const std::string bytes = ReadFile(packed);
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, bytes.data()));
  EXPECT_CU(cuModuleGetFunction(&f, module, "scale_cols"));  // opaque: any name
  for (const std::string& path : {ptx, cubin, fat, packed}) unlink(path.c_str());
}

float KernelMs(CUfunction gate, CUfunction f) {
  CUevent start = nullptr, end = nullptr;
  float ms = -1;
  if (cuEventCreate(&start, 0) != CUDA_SUCCESS || cuEventCreate(&end, 0) != CUDA_SUCCESS) return ms;
  cuLaunchKernel(gate, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr);
  cuEventRecord(start, nullptr);
  cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr);
  cuEventRecord(end, nullptr);
  cuEventSynchronize(end);
  cuEventElapsedTime(&ms, start, end);
  return ms;
}

TEST_F(FakeCuda, KernelDurationsComeFromTheEnvironment) {
  setenv("FAKECUDA_KERNEL_US", "saxpy=2000,*=500,spin_300us=9", 1);
  InitWithContext();
  CUmodule module = nullptr;
  ASSERT_CU(
      cuModuleLoadData(&module, ".entry saxpy(){} .entry axpby(){} .entry spin_300us(){} .entry spin_50000us(){}"));
  CUfunction saxpy = nullptr, other = nullptr, spin = nullptr, gate = nullptr;
  ASSERT_CU(cuModuleGetFunction(&gate, module, "spin_50000us"));
  ASSERT_CU(cuModuleGetFunction(&saxpy, module, "saxpy"));
  ASSERT_CU(cuModuleGetFunction(&other, module, "axpby"));
  ASSERT_CU(cuModuleGetFunction(&spin, module, "spin_300us"));
  EXPECT_NEAR(KernelMs(gate, saxpy), 2.0, 1e-3);
  EXPECT_NEAR(KernelMs(gate, other), 0.5, 1e-3);  // the "*" default
  EXPECT_NEAR(KernelMs(gate, spin), 0.3, 1e-3);   // spin_<N>us keeps its meaning
}

TEST_F(FakeCuda, MalformedKernelDurationsAreRefused) {
  setenv("FAKECUDA_KERNEL_US", "saxpy=fast", 1);
  InitWithContext();
  CUmodule module = nullptr;
  EXPECT_EQ(cuModuleLoadData(&module, ".entry saxpy(){}"), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, LinkerOutputHoldsEveryInput) {
  InitWithContext();
  char info[64] = "stale", error[64] = "stale";
  CUjit_option options[] = {CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER,
                            CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {info, reinterpret_cast<void*>(sizeof(info)), error, reinterpret_cast<void*>(sizeof(error))};
  CUlinkState link = nullptr;
  ASSERT_CU(cuLinkCreate(4, options, values, &link));
  void* out = nullptr;
  size_t size = 0;
  EXPECT_EQ(cuLinkComplete(link, &out, &size), CUDA_ERROR_INVALID_VALUE);  // nothing added yet
  char ptx[] = ".visible .entry from_ptx() { ret; }";
  std::string cubin = MakeCubin("from_cubin");
  ASSERT_CU(cuLinkAddData(link, CU_JIT_INPUT_PTX, ptx, sizeof(ptx), "a.ptx", 0, nullptr, nullptr));
  ASSERT_CU(cuLinkAddData(link, CU_JIT_INPUT_CUBIN, cubin.data(), cubin.size(), "b.cubin", 0, nullptr, nullptr));
  EXPECT_EQ(cuLinkAddData(link, CU_JIT_INPUT_NVVM, ptx, sizeof(ptx), "c.ltoir", 0, nullptr, nullptr),
            CUDA_ERROR_INVALID_VALUE);  // LTO-IR needs CU_JIT_LTO
  EXPECT_EQ(cuLinkAddFile(link, CU_JIT_INPUT_PTX, "/nonexistent.ptx", 0, nullptr, nullptr), CUDA_ERROR_FILE_NOT_FOUND);
  ASSERT_CU(cuLinkComplete(link, &out, &size));
  EXPECT_STREQ(info, "");
  EXPECT_STREQ(error, "");
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, out));
  EXPECT_CU(cuModuleGetFunction(&f, module, "from_ptx"));
  EXPECT_CU(cuModuleGetFunction(&f, module, "from_cubin"));
  EXPECT_EQ(cuModuleGetFunction(&f, module, "from_nowhere"), CUDA_ERROR_NOT_FOUND);
  ASSERT_CU(cuLinkDestroy(link));
  EXPECT_EQ(cuLinkDestroy(link), CUDA_ERROR_INVALID_HANDLE);
}

TEST_F(FakeCuda, KernelAttributesAndOccupancy) {
  setenv("FAKECUDA_SMS", "100", 1);
  InitWithContext();
  CUlibrary library = nullptr;
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, ".entry k(){}", nullptr, nullptr, 0, nullptr, nullptr, 0));
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "k"));
  ASSERT_CU(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536, kernel, 0));
  int value = 0;
  ASSERT_CU(cuKernelGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel, 0));
  EXPECT_EQ(value, 65536);
  EXPECT_EQ(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_NUM_REGS, 64, kernel, 0), CUDA_ERROR_INVALID_VALUE);  // read-only
  EXPECT_EQ(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 101, kernel, 0),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuKernelGetAttribute(&value, CU_FUNC_ATTRIBUTE_NUM_REGS, kernel, 7), CUDA_ERROR_INVALID_DEVICE);
  auto f = reinterpret_cast<CUfunction>(kernel);
  int min_grid = 0, block = 0;
  ASSERT_CU(cuOccupancyMaxPotentialBlockSize(&min_grid, &block, f, nullptr, 0, 0));
  EXPECT_EQ(block, 1024);
  EXPECT_EQ(min_grid, 2 * 100);  // 64 warps per SM: two 1024-thread blocks on each of 100 SMs
  ASSERT_CU(cuOccupancyMaxPotentialBlockSize(&min_grid, &block, f, nullptr, 0, 100));
  EXPECT_EQ(block, 64);  // 32 blocks of 2 warps fill an SM; 96 threads: 21 blocks of 3 warps do not
  EXPECT_EQ(min_grid, 32 * 100);
  ASSERT_CU(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&value, f, 256, 100 * 1024, 0));
  EXPECT_EQ(value, 2);  // shared memory: 228 KiB per SM
  size_t shared = 0;
  ASSERT_CU(cuOccupancyAvailableDynamicSMemPerBlock(&shared, f, 4, 128));
  EXPECT_EQ(shared, 233472u / 4);
}

TEST_F(FakeCuda, CaptureInfoAndProfiler) {
  InitWithContext();
  CUstream stream = nullptr;
  ASSERT_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  cuuint64_t id = 0;
  ASSERT_CU(cuStreamGetCaptureInfo(stream, &status, &id, nullptr, nullptr, nullptr, nullptr));
  EXPECT_EQ(status, CU_STREAM_CAPTURE_STATUS_NONE);
  ASSERT_CU(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUgraph graph = nullptr;
  size_t deps = 99;
  ASSERT_CU(cuStreamGetCaptureInfo(stream, &status, &id, &graph, nullptr, nullptr, &deps));
  EXPECT_EQ(status, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  EXPECT_NE(graph, nullptr);
  EXPECT_EQ(deps, 0u);
  CUgraph ended = nullptr;
  ASSERT_CU(cuStreamEndCapture(stream, &ended));
  EXPECT_EQ(ended, graph);
  void* start = nullptr;
  CUdriverProcAddressQueryResult found{};
  ASSERT_CU(cuGetProcAddress("cuProfilerStart", &start, 13000, 0, &found));
  ASSERT_NE(start, nullptr);
  EXPECT_CU(reinterpret_cast<CUresult (*)()>(start)());
}

}  // namespace
