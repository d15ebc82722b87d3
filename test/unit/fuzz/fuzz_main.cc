// A deterministic stand-in for libFuzzer: runs the target over its seeds and
// over mutations of them from a fixed random sequence, for a bounded number of
// inputs and seconds. Arguments are files to replay (crash reproduction).
//   fuzz_x [--runs N] [--seconds S] [--corpus DIR] [FILE...]
//   (--corpus: every file of DIR is replayed first, then the mutation runs)
//   fuzz_x --write-corpus DIR     (seeds for the libFuzzer build)
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "fuzz_target.h"

namespace {

std::string mutate(std::string s, std::mt19937_64& rng, const std::vector<std::string>& seeds) {
  static const char* const kTokens[] = {"=",         ",",
                                        "0",         "9",
                                        "Gi",        "G",
                                        "Ki",        "B",
                                        "%",         "\n",
                                        "-",         ".",
                                        "_0",        "_15",
                                        "_16",       "18446744073709551615",
                                        "GPUSLICE_", "CUDA_DEVICE_",
                                        "\xff",      " "};
  const int edits = 1 + static_cast<int>(rng() % 6);
  for (int e = 0; e < edits; ++e) {
    const std::size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 7) {
      case 0:  // flip a byte
        if (!s.empty()) s[pos % s.size()] = static_cast<char>(rng());
        break;
      case 1:  // insert a byte
        s.insert(pos, 1, static_cast<char>(rng()));
        break;
      case 2:  // delete a range
        if (!s.empty()) s.erase(pos % s.size(), 1 + rng() % 8);
        break;
      case 3:  // insert a token
        s.insert(pos, kTokens[rng() % (sizeof kTokens / sizeof kTokens[0])]);
        break;
      case 4:  // splice another seed
        s.insert(pos, seeds[rng() % seeds.size()].substr(0, 64));
        break;
      case 5:  // truncate
        s.resize(pos);
        break;
      case 6:  // overwrite 8 bytes with an interesting integer
        if (s.size() >= 8) {
          static const std::uint64_t kInts[] = {0, 1, 2, 0xffffffffffffffffull, 665088, 512, 16, 1024};
          const std::uint64_t v = kInts[rng() % 8];
          std::memcpy(&s[(pos / 8 * 8) % (s.size() - 7)], &v, 8);
        }
        break;
    }
  }
  return s;
}

void run(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(input.data()), input.size());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream data;
  data << in.rdbuf();
  return data.str();
}

// Replays every file of dir (sorted); how many.
std::size_t replay_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    }
    closedir(d);
  } else {
    std::fprintf(stderr, "cannot read the corpus %s\n", dir.c_str());
    std::exit(2);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) run(read_file(dir + "/" + n));
  return names.size();
}

}  // namespace

int main(int argc, char** argv) {
  long runs = 200000;
  double seconds = 3.0;
  std::vector<std::string> files;
  std::string corpus;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--write-corpus") == 0 && i + 1 < argc) {
      const std::vector<std::string> seeds = gpuslice::fuzz::seeds();
      for (std::size_t k = 0; k < seeds.size(); ++k) {
        std::ofstream out(std::string(argv[i + 1]) + "/seed-" + std::to_string(k), std::ios::binary);
        out.write(seeds[k].data(), static_cast<std::streamsize>(seeds[k].size()));
      }
      std::printf("wrote %zu seeds to %s\n", seeds.size(), argv[i + 1]);
      return 0;
    }
    if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc) {
      runs = std::atol(argv[++i]);
    } else if (std::strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--corpus") == 0 && i + 1 < argc) {
      corpus = argv[++i];
    } else {
      files.push_back(argv[i]);
    }
  }
  if (!files.empty()) {
    for (const std::string& f : files) run(read_file(f));
    std::printf("replayed %zu inputs\n", files.size());
    return 0;
  }
  if (!corpus.empty()) std::printf("replayed %zu inputs of %s\n", replay_dir(corpus), corpus.c_str());
  const std::vector<std::string> seeds = gpuslice::fuzz::seeds();
  for (const std::string& s : seeds) run(s);
  std::mt19937_64 rng(0x6770757331696365ull);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  long done = 0;
  std::string current = seeds[0];
  for (; done < runs; ++done) {
    if (std::chrono::steady_clock::now() > deadline) break;  // every input: some take milliseconds
    // Mostly mutate fresh seeds, sometimes keep mutating the last input.
    if (rng() % 4 != 0) current = seeds[rng() % seeds.size()];
    current = mutate(current, rng, seeds);
    if (current.size() > 600000) current.resize(600000);
    run(current);
  }
  std::printf("ran %ld inputs over %zu seeds\n", done, seeds.size());
  return 0;
}
