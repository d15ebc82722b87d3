#include <cstdio>
extern "C" int layered(void);
int main() {
  std::printf("layered value=%d\n", layered());
  return 0;
}
