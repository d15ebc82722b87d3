extern "C" int layered(void) { return 100; }
