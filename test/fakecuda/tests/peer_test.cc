// Peer access (peer.cc): every pair of distinct devices can access each
// other, access is enabled per pair of contexts and one way, with the
// documented errors, and holds no device memory.
#include "common.h"

using namespace fakecuda_test;

namespace {

TEST_F(FakeCuda, PeerAccessBetweenEightDevices) {
  setenv("FAKECUDA_DEVICES", "8", 1);
  ASSERT_CU(cuInit(0));
  CUcontext ctx[8] = {};
  for (int d = 0; d < 8; ++d) ASSERT_CU(cuCtxCreate(&ctx[d], nullptr, 0, d));
  int can = -1;
  ASSERT_CU(cuDeviceCanAccessPeer(&can, 3, 3));
  EXPECT_EQ(can, 0) << "a device is not its own peer";
  EXPECT_EQ(cuDeviceCanAccessPeer(&can, 0, 8), CUDA_ERROR_INVALID_DEVICE);
  for (int d = 0; d < 8; ++d) {
    ASSERT_CU(cuCtxSetCurrent(ctx[d]));
    for (int p = 0; p < 8; ++p) {
      if (p == d) continue;
      ASSERT_CU(cuDeviceCanAccessPeer(&can, d, p));
      EXPECT_EQ(can, 1);
      ASSERT_CU(cuCtxEnablePeerAccess(ctx[p], 0));
    }
    EXPECT_EQ(cuCtxEnablePeerAccess(ctx[(d + 1) % 8], 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    EXPECT_EQ(cuCtxEnablePeerAccess(ctx[d], 0), CUDA_ERROR_INVALID_CONTEXT) << "the current context itself";
  }
  for (int d = 0; d < 8; ++d) EXPECT_EQ(fakecuda_device_used_bytes(d), 0u) << "peer access holds no memory";
  ASSERT_CU(cuCtxSetCurrent(ctx[0]));
  EXPECT_EQ(cuCtxEnablePeerAccess(ctx[1], 1), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuCtxDisablePeerAccess(ctx[1]));
  EXPECT_EQ(cuCtxDisablePeerAccess(ctx[1]), CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
  // One way: 1 -> 0 stays enabled after 0 -> 1 is disabled.
  ASSERT_CU(cuCtxSetCurrent(ctx[1]));
  EXPECT_EQ(cuCtxEnablePeerAccess(ctx[0], 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  // A destroyed peer: invalid, and its access went with it.
  ASSERT_CU(cuCtxDestroy(ctx[7]));
  EXPECT_EQ(cuCtxDisablePeerAccess(ctx[7]), CUDA_ERROR_INVALID_CONTEXT);
  for (CUcontext cur = nullptr; cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != nullptr;) cuCtxPopCurrent(nullptr);
  EXPECT_EQ(cuCtxEnablePeerAccess(ctx[2], 0), CUDA_ERROR_INVALID_CONTEXT) << "no current context";
}

}  // namespace
