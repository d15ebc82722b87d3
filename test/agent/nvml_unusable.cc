// An NVML that loads but cannot start (as on a node whose driver is not
// loaded): nvmlInit_v2 returns NVML_ERROR_DRIVER_NOT_LOADED. Given to the
// library as GPUSLICE_REAL_LIBNVML, it leaves the library without NVML while
// CUDA keeps working (an override that does not load at all fails closed).
extern "C" {
__attribute__((visibility("default"))) int nvmlInit_v2(void) { return 9; }  // NVML_ERROR_DRIVER_NOT_LOADED
__attribute__((visibility("default"))) int nvmlInit(void) { return 9; }
__attribute__((visibility("default"))) int nvmlShutdown(void) { return 0; }
}
