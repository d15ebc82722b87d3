// shared_peer: one rank of an NCCL- or vLLM-shaped set-up, for
// shared_memory_test.cc. Handles travel over a Unix socket, as NCCL sends
// them (a POSIX file descriptor with SCM_RIGHTS; a CUipcMemHandle as bytes).
//   shared_peer export vmm|ipc BYTES SOCKET   creates BYTES on device 0
//       (vmm: cuMemCreate with a POSIX-fd handle type, mapped, access set;
//       ipc: cuMemAlloc) and listens on SOCKET
//   shared_peer import vmm|ipc SOCKET [BYTES]  connects, receives the handle
//       and maps it (vmm: import, reserve and map BYTES, set access; ipc: open)
// Then one command a line on stdin, each answered by one line on stdout:
//   serve        (exporter) accept one peer and send it the handle: "serve rc=R"
//   release      let go of the shared memory (exporter: unmap + release, or
//                cuMemFree; importer: unmap + release, or cuIpcCloseMemHandle)
//   free         (ipc importer) cuMemFree on the opened pointer: "free rc=R"
//   self         (ipc exporter) open its own handle: "self rc=R"
//   alloc N      cuMemAlloc N bytes, then free them: "alloc rc=R"
//   host N       cuMemCreate N bytes located on the host (HOST, then
//                HOST_NUMA node 0), kept: "host rc=R" (the first failure)
//   quit
#include <cuda.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fd_passing.h"

namespace {

bool vmm = false;
size_t bytes = 0;
CUmemGenericAllocationHandle handle = 0;
CUdeviceptr va = 0;    // vmm: the reservation mapped; ipc: the pointer
CUipcMemHandle ipc{};  // ipc exporter: the handle
int listener = -1;
const char* socket_path = nullptr;

void say(const char* what, int rc) {
  std::printf("%s rc=%d\n", what, rc);
  std::fflush(stdout);
}

sockaddr_un address() {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", socket_path);
  return a;
}

CUmemAllocationProp device_prop() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

CUresult map_handle() {
  CUresult rc = cuMemAddressReserve(&va, bytes, 0, 0, 0);
  if (rc == CUDA_SUCCESS) rc = cuMemMap(va, bytes, 0, handle, 0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (rc == CUDA_SUCCESS) rc = cuMemSetAccess(va, bytes, &access, 1);
  return rc;
}

CUresult release_vmm() {
  CUresult rc = cuMemUnmap(va, bytes);
  if (rc == CUDA_SUCCESS) rc = cuMemRelease(handle);
  if (rc == CUDA_SUCCESS) rc = cuMemAddressFree(va, bytes);
  return rc;
}

int serve() {
  const int peer = accept(listener, nullptr, nullptr);
  if (peer < 0) return -1;
  int rc = 0;
  if (vmm) {
    int fd = -1;
    if (cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS)
      return -2;
    if (!gpuslice::test::send_fd(peer, fd)) rc = -3;
    close(fd);
  } else if (write(peer, &ipc, sizeof ipc) != static_cast<ssize_t>(sizeof ipc)) {
    rc = -3;
  }
  close(peer);
  return rc;
}

// The importer's set-up: connect (the exporter may not listen yet), receive, map.
int import() {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_un a = address();
  bool connected = false;
  for (int i = 0; i < 1000 && !connected; ++i) {
    connected = connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
    if (!connected) usleep(10 * 1000);
  }
  if (!connected) return -1;
  if (vmm) {
    const int fd = gpuslice::test::receive_fd(s);
    if (fd < 0) return -2;
    CUresult rc = cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    close(s);
    return static_cast<int>(rc);
  }
  if (read(s, &ipc, sizeof ipc) != static_cast<ssize_t>(sizeof ipc)) return -2;
  close(s);
  return static_cast<int>(cuIpcOpenMemHandle(&va, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  const bool exporter = std::strcmp(argv[1], "export") == 0;
  vmm = std::strcmp(argv[2], "vmm") == 0;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    say(exporter ? "ready" : "import", -100);
    return 1;
  }
  if (exporter) {
    if (argc != 5) return 2;
    bytes = std::strtoull(argv[3], nullptr, 10);
    socket_path = argv[4];
    CUresult rc;
    if (vmm) {
      const CUmemAllocationProp prop = device_prop();
      rc = cuMemCreate(&handle, bytes, &prop, 0);
      if (rc == CUDA_SUCCESS) rc = map_handle();
    } else {
      rc = cuMemAlloc(&va, bytes);
      if (rc == CUDA_SUCCESS) rc = cuIpcGetMemHandle(&ipc, va);
    }
    listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_un a = address();
    unlink(socket_path);
    if (bind(listener, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 || listen(listener, 4) != 0)
      rc = CUDA_ERROR_UNKNOWN;
    say("ready", static_cast<int>(rc));
  } else {
    socket_path = argv[3];
    if (vmm && argc == 5) bytes = std::strtoull(argv[4], nullptr, 10);
    int rc = import();
    if (vmm && rc == 0) rc = static_cast<int>(map_handle());
    say("import", rc);
  }
  char line[256];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    const std::string cmd(line, std::strcspn(line, "\n"));
    if (cmd == "serve") {
      say("serve", serve());
    } else if (cmd == "release") {
      const CUresult rc = vmm ? release_vmm() : (exporter ? cuMemFree(va) : cuIpcCloseMemHandle(va));
      say("release", static_cast<int>(rc));
    } else if (cmd == "free") {
      say("free", static_cast<int>(cuMemFree(va)));
    } else if (cmd == "self") {
      CUdeviceptr p = 0;
      say("self", static_cast<int>(cuIpcOpenMemHandle(&p, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)));
    } else if (cmd.rfind("alloc ", 0) == 0) {
      CUdeviceptr p = 0;
      const CUresult rc = cuMemAlloc(&p, std::strtoull(cmd.c_str() + 6, nullptr, 10));
      if (rc == CUDA_SUCCESS) cuMemFree(p);
      say("alloc", static_cast<int>(rc));
    } else if (cmd.rfind("host ", 0) == 0) {
      const size_t n = std::strtoull(cmd.c_str() + 5, nullptr, 10);
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
      prop.location.id = 3;  // ignored for HOST: never a device ordinal
      CUmemGenericAllocationHandle h1 = 0, h2 = 0;
      CUresult rc = cuMemCreate(&h1, n, &prop, 0);
      prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      prop.location.id = 0;  // NUMA node 0, not device 0
      if (rc == CUDA_SUCCESS) rc = cuMemCreate(&h2, n, &prop, 0);
      say("host", static_cast<int>(rc));
    } else if (cmd == "quit") {
      break;
    } else {
      say("unknown", -1);
    }
  }
  if (listener >= 0) unlink(socket_path);
  return 0;
}
