// The configuration file (file.h): read, split into NAME=VALUE
// entries, merged under the environment option by option, resolved with the
// environment's parser.
#include "limiter/options/file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "limiter/options/env.h"
#include "platform/fs.h"
#include "platform/text.h"

namespace gpuslice::options {
namespace {

using platform::Text;

bool blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

constexpr std::size_t option_index(const char* env) {
  for (std::size_t k = 0; k < kOptionCount; ++k) {
    const char* a = kOptions[k].env;
    const char* b = env;
    while (*a != '\0' && *a == *b) ++a, ++b;
    if (*a == *b) return k;
  }
  return kOptionCount;
}

// constexpr: another library's constructor may reach bootstrap before this
// library's dynamic initialisers have run.
constexpr std::size_t kConfigOption = option_index("GPUSLICE_CONFIG_FILE");
static_assert(kConfigOption < kOptionCount);

// Whether entry "NAME=..." has the name `name` (which ends at '\0' or '=').
bool same_name(const char* entry, const char* name) {
  std::size_t i = 0;
  for (; entry[i] != '=' && entry[i] != '\0'; ++i) {
    if (name[i] != entry[i]) return false;
  }
  return name[i] == '=' || name[i] == '\0';
}

// "gpuslice: FILE:LINE: " -- the caller appends "<what>, expected <what>".
platform::Text at_line(shm::Error* err, const char* path, std::uint32_t line) {
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: ").escaped(path, 200).ch(':').u64(line).str(": ");
  return t;
}

constexpr const char* kLineExpected =
    "expected NAME=VALUE (a gpuslice option or HAMi alias), a # comment or a blank line";

// Reads the file into buf->text (NUL-terminated). *absent: the default file
// is not there, which is no error.
bool read_file(const char* path, bool named, ConfigFileBuffer* buf, bool* absent, shm::Error* err) {
  *absent = false;
  // Without blocking: a FIFO (or a device) would wait for a writer forever,
  // inside cuInit. Anything but a regular file is refused below.
  const int fd = platform::open_at(AT_FDCWD, path, O_RDONLY | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (!named && (e == ENOENT || e == ENOTDIR)) {
      *absent = true;
      return true;
    }
    platform::Text t(err->message, sizeof err->message);
    t.str("gpuslice: ");
    if (named) t.str("GPUSLICE_CONFIG_FILE=").quoted(path, 200).str(": ");
    t.str("cannot open the configuration file ")
        .escaped(path, 200)
        .str(": ")
        .errno_text(e)
        .str(", expected a readable file of NAME=VALUE lines");
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    platform::Text t(err->message, sizeof err->message);
    t.str("gpuslice: ");
    if (named) t.str("GPUSLICE_CONFIG_FILE=").quoted(path, 200).str(": ");
    t.str("the configuration file ")
        .escaped(path, 200)
        .str(" is not a regular file (a FIFO, a device or a directory), expected a file of NAME=VALUE lines");
    return false;
  }
  std::size_t total = 0;
  for (;;) {
    const ssize_t n = read(fd, buf->text + total, kConfigFileMaxBytes + 1 - total);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      close(fd);
      platform::Text t(err->message, sizeof err->message);
      t.str("gpuslice: cannot read the configuration file ").escaped(path, 200).str(": ").errno_text(e);
      return false;
    }
    if (n == 0) break;
    total += static_cast<std::size_t>(n);
    if (total > kConfigFileMaxBytes) {
      close(fd);
      platform::Text t(err->message, sizeof err->message);
      t.str("gpuslice: the configuration file ")
          .escaped(path, 200)
          .str(" is larger than ")
          .u64(kConfigFileMaxBytes)
          .str(" bytes, expected at most that");
      return false;
    }
  }
  close(fd);
  buf->text[total] = '\0';
  for (std::size_t i = 0; i < total; ++i) {
    if (buf->text[i] == '\0') {
      std::uint32_t line = 1;
      for (std::size_t j = 0; j < i; ++j) line += buf->text[j] == '\n';
      at_line(err, path, line).str("NUL byte in the line, ").str(kLineExpected);
      return false;
    }
  }
  return true;
}

// Splits buf->text into "NAME=VALUE" entries (in place), checking each name.
bool split_entries(const char* path, ConfigFileBuffer* buf, shm::Error* err) {
  std::size_t count = 0;
  std::uint32_t line = 0;
  char* p = buf->text;
  while (*p != '\0') {
    ++line;
    char* end = p;
    while (*end != '\0' && *end != '\n') ++end;
    char* const next = *end == '\n' ? end + 1 : end;
    char* b = p;
    char* e = end;
    while (b < e && blank(*b)) ++b;
    while (e > b && blank(e[-1])) --e;
    p = next;
    if (b == e || *b == '#') continue;
    char* eq = b;
    while (eq < e && *eq != '=') ++eq;
    char* name_end = eq;
    while (name_end > b && blank(name_end[-1])) --name_end;
    if (eq == e || name_end == b) {
      char shown[81];
      std::size_t n = 0;
      for (; n < sizeof shown - 1 && b + n < e; ++n) shown[n] = b[n];
      shown[n] = '\0';
      platform::Text t = at_line(err, path, line);
      t.quoted(shown, 72).str(eq == e ? " has no '=', " : " has no name before '=', ").str(kLineExpected);
      return false;
    }
    char* value = eq + 1;
    while (value < e && blank(*value)) ++value;
    // "NAME=VALUE" in place: the value moves left, over the blanks around '='.
    const std::size_t value_len = static_cast<std::size_t>(e - value);
    *name_end = '=';
    for (std::size_t i = 0; i < value_len; ++i) name_end[1 + i] = value[i];
    name_end[1 + value_len] = '\0';
    char* entry = b;
    const env::Name kind = env::classify(entry);
    if (kind != env::Name::option && kind != env::Name::alias) {
      char name[72];
      env::name_of(entry, name, sizeof name);
      platform::Text t = at_line(err, path, line);
      t.quoted(name, 64);
      if (kind == env::Name::bad_device_index) {
        t.str(": bad device index in the name, expected <alias>_<i> with i in 0-").u64(kMaxDevices - 1);
      } else {
        t.str(" is not a gpuslice option or HAMi alias, expected a name from the README's option table");
      }
      return false;
    }
    if (same_name(entry, "GPUSLICE_CONFIG_FILE")) {
      at_line(err, path, line).str("GPUSLICE_CONFIG_FILE names the file itself, expected it in the environment only");
      return false;
    }
    for (std::size_t i = 0; i < count; ++i) {
      if (same_name(buf->entries[i], entry)) {
        char name[72];
        env::name_of(entry, name, sizeof name);
        at_line(err, path, line)
            .str(name)
            .str(" is already set on line ")
            .u64(buf->lines[i])
            .str(", expected each name at most once");
        return false;
      }
    }
    if (count == kConfigFileMaxEntries) {  // unreachable: every name is known and distinct
      at_line(err, path, line).str("too many settings, expected at most ").u64(kConfigFileMaxEntries);
      return false;
    }
    buf->entries[count] = entry;
    buf->lines[count] = line;
    buf->used[count] = false;
    ++count;
  }
  buf->entries[count] = nullptr;
  return true;
}

// The file's line that set `name`, among the entries taken, or 0.
std::uint32_t line_of(const ConfigFileBuffer& buf, const char* name) {
  for (std::size_t i = 0; buf.entries[i] != nullptr; ++i) {
    if (buf.used[i] && same_name(buf.entries[i], name)) return buf.lines[i];
  }
  return 0;
}

void mark(OptionSource& s, const ConfigFileBuffer& buf) { s.line = line_of(buf, s.name); }
template <std::size_t N>
void mark(OptionSource (&s)[N], const ConfigFileBuffer& buf) {
  for (OptionSource& one : s) mark(one, buf);
}

// "gpuslice: NAME='value': ..." about a value from the file becomes
// "gpuslice: FILE:LINE: NAME='value': ...".
void locate_error(const char* path, const ConfigFileBuffer& buf, shm::Error* err) {
  constexpr char kPrefix[] = "gpuslice: ";
  const char* rest = err->message;
  for (const char* p = kPrefix; *p != '\0'; ++p, ++rest) {
    if (*rest != *p) return;
  }
  const std::uint32_t line = line_of(buf, rest);
  if (line == 0) return;
  shm::Error located;
  platform::Text t(located.message, sizeof located.message);
  t.str(kPrefix).escaped(path, 200).ch(':').u64(line).str(": ").str(rest);
  platform::Text(err->message, sizeof err->message).str(located.message);
}

}  // namespace

bool load_options(char* const* envp, const char* default_file, ConfigFileBuffer* buf, Options* out,
                  shm::Error* err) noexcept {
  default_options(out);
  err->message[0] = '\0';
  buf->entries[0] = nullptr;
  env::Found found;
  if (!env::collect(envp, &found, out, err)) return false;
  // The environment's own values first: its errors are errors whatever the
  // file says, and it names the file.
  if (!resolve_found(found, out, err)) return false;
  const bool named = found.ours[kConfigOption] != nullptr;
  platform::copy_string(buf->path, sizeof buf->path, named ? out->config_file : default_file);
  if (!named) platform::copy_string(out->config_file, sizeof out->config_file, default_file);
  const char* path = buf->path;
  bool absent = false;
  if (!read_file(path, named, buf, &absent, err)) return false;
  if (absent) return true;
  if (!split_entries(path, buf, err)) return false;
  env::Found from_file;
  if (!env::collect(buf->entries, &from_file, out, err)) return false;  // names checked: cannot fail
  for (std::size_t k = 0; k < kOptionCount; ++k) {
    if (!env::sets(found, k) && env::sets(from_file, k)) env::take(&found, from_file, k);
  }
  // Which entries were taken: those whose value pointer is now in `found`.
  for (std::size_t i = 0; buf->entries[i] != nullptr; ++i) {
    const char* value = buf->entries[i];
    while (*value != '=') ++value;
    ++value;
    bool taken = false;
    for (std::size_t k = 0; k < kOptionCount && !taken; ++k) taken = found.ours[k] == value;
    for (std::size_t a = 0; a < kOptionAliasCount && !taken; ++a) {
      taken = found.alias[a] == value;
      for (std::uint32_t d = 0; d < kMaxDevices && !taken; ++d) taken = found.alias_device[a][d] == value;
    }
    buf->used[i] = taken;
  }
  if (!resolve_found(found, out, err)) {
    locate_error(path, *buf, err);
    return false;
  }
  if (!named) platform::copy_string(out->config_file, sizeof out->config_file, path);
    // Sources that name a variable the file set (and the environment did not).
#define GPUSLICE_OPTION(id, env, kind, def, range, doc) mark(out->id##_source, *buf);
#include "gpuslice/options.def"
#undef GPUSLICE_OPTION
  out->config_file_read = true;
  err->message[0] = '\0';
  return true;
}

}  // namespace gpuslice::options
