#include <cstdio>

extern "C" int ctor_alloc_rc;
extern "C" int ctor_oversize_rc;

int main() {
  std::printf("ctor oversize_rc=%d alloc_rc=%d\n", ctor_oversize_rc, ctor_alloc_rc);
  return 0;
}
