// tests/traces/kill_at_write.c — an LD_PRELOAD shim for crash tests: SIGKILLs a recorder at an
// exact point of a flush, so that a test can aim at the few writes in which HDF5 restructures
// a chunk index instead of hoping a random kill lands there.
//
// It watches the writes to the trace file (HDF5's sec2 driver writes with pwrite in 1.10)
// for version-1 B-tree nodes of chunk indexes (signature "TREE", node type 1; HDF5 may merge
// several metadata blocks into one write, so every write is scanned) and numbers two kinds
// of index events, in write order:
//   new     a node written at an offset where none was before (a table's first node, or a
//           node that a split created);
//   reroot  a node written at a known offset with a higher level than before (the root of a
//           table's index re-rooted in place when it split).
// Those numbers depend only on the order in which chunks are added, not on timing.
//
// Environment (read once):
//   LOCKSTEP_KILL_PATH   the trace; writes to it or to <it>.partial are watched
//   LOCKSTEP_KILL_EVENT  "E:D": SIGKILL the process right before the D-th write counted from
//                        the write that holds event E (D = 0: that write itself is not made)
//   LOCKSTEP_WRITE_LOG   append "index offset bytes [new:E|reroot:E]…" per watched write
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// Offsets of the nodes seen so far and their highest level (a small open-addressing table;
// a test trace has a few thousand nodes at most).
enum { kSlots = 1 << 16 };
static long long node_offset[kSlots];
static unsigned char node_level[kSlots];
static unsigned char node_used[kSlots];

static long writes = 0, events = 0;
static long kill_event = -1, kill_delay = 0, kill_at_write = -1;
static const char* want = NULL;
static const char* log_path = NULL;
static int configured = 0;

static void Configure(void) {
  configured = 1;
  want = getenv("LOCKSTEP_KILL_PATH");
  log_path = getenv("LOCKSTEP_WRITE_LOG");
  const char* k = getenv("LOCKSTEP_KILL_EVENT");
  if (k) sscanf(k, "%ld:%ld", &kill_event, &kill_delay);
}

static int IsTrace(int fd) {
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return 0;
  path[n] = 0;
  const size_t w = strlen(want);
  return strncmp(path, want, w) == 0 && (path[w] == 0 || strcmp(path + w, ".partial") == 0);
}

// Returns the event kind of a node at `offset` with `level` ("new", "reroot" or NULL).
static const char* Note(long long offset, int level) {
  unsigned long h = (unsigned long long)offset * 0x9E3779B97F4A7C15ull >> 48;
  for (;; h = (h + 1) & (kSlots - 1)) {
    if (!node_used[h]) {
      node_used[h] = 1;
      node_offset[h] = offset;
      node_level[h] = (unsigned char)level;
      return "new";
    }
    if (node_offset[h] == offset) {
      if (level > node_level[h]) {
        node_level[h] = (unsigned char)level;
        return "reroot";
      }
      return NULL;
    }
  }
}

ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
  static ssize_t (*real)(int, const void*, size_t, off_t) = NULL;
  if (!real) real = (ssize_t(*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
  if (!configured) Configure();
  if (want && IsTrace(fd)) {
    const long index = ++writes;
    char line[4096];
    int at = snprintf(line, sizeof line, "%ld %lld %zu", index, (long long)offset, count);
    const unsigned char* b = (const unsigned char*)buf;
    // A node: "TREE", type 1 (chunked raw data), a small level.
    for (size_t j = 0; j + 8 <= count; ++j) {
      if (b[j] != 'T' || memcmp(b + j, "TREE", 4) != 0 || b[j + 4] != 1 || b[j + 5] > 8) continue;
      const char* kind = Note((long long)offset + (long long)j, b[j + 5]);
      if (!kind) continue;
      ++events;
      if (at < (int)sizeof line - 32) at += snprintf(line + at, sizeof line - at, " %s:%ld", kind, events);
      if (events == kill_event) kill_at_write = index + kill_delay;
    }
    if (log_path) {
      FILE* f = fopen(log_path, "a");
      if (f) {
        fprintf(f, "%s\n", line);
        fclose(f);
      }
    }
    if (index == kill_at_write) raise(SIGKILL);
  }
  return real(fd, buf, count, offset);
}
