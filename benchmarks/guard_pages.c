// A guard-page allocator, preloaded into a process to make a memory misuse fault at once
// (electric-fence style), with faulthandler then naming the Python stack that made it.
//
// Every posix_memalign (torch's CPU tensor storage) of at least GUARD_MIN bytes (default 1),
// and every malloc / calloc of at least GUARD_MALLOC_MIN bytes (default: none; gloo's own
// buffers, Python's large objects), gets pages of its own: the block ends at an inaccessible
// page (GUARD_UNDER=1: starts after one), so a read or write past its end (before its start)
// faults; a freed block is made inaccessible and held in a quarantine of QUARANTINE blocks
// before its pages are returned, so a read or write after free faults too — by any thread,
// gloo's included. Past LIVE_LIMIT live blocks (the kernel's map count) the rest go to glibc.
// GUARD_THREADS=<prefix>[,<prefix>...] guards every malloc / calloc / posix_memalign, of any
// size, made by a thread whose name starts with one of them (pt_gloo,gloo_tcp: gloo's worker
// and transport threads): a small object of theirs written after its free faults at the
// writer, where a whole-process guard would pass the kernel's map count.
//
// Build and use (docs/distributed.md, the MoE tp=2 case):
//   gcc -O2 -shared -fPIC -o /tmp/guard_pages.so benchmarks/guard_pages.c -ldl -lpthread
//   GUARD_MALLOC_MIN=1024 LD_PRELOAD=/tmp/guard_pages.so .venv/bin/python -m pytest ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define SLOTS (1u << 21)  // the open-addressing table of live blocks
#define QUARANTINE 6000
#define LIVE_LIMIT 20000
#define PAGE 4096

typedef struct {
  uintptr_t ptr, base;
  size_t len, size;
} block_t;

static block_t table[SLOTS];
static struct {
  uintptr_t base;
  size_t len;
} held[QUARANTINE];
static unsigned held_first, held_count;
static long live;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int (*real_memalign)(void **, size_t, size_t);
static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void (*real_free)(void *);
static size_t memalign_min = 1, malloc_min = (size_t)-1;
static int under;
static char thread_prefixes[256];  // GUARD_THREADS, commas turned into NULs, NUL-NUL ended

// whether this thread's allocations are all guarded: its name read again every 4096 calls
// until it matches (a thread is named after it starts); initial-exec TLS allocates nothing
static __thread int thread_state __attribute__((tls_model("initial-exec")));
static __thread unsigned thread_calls __attribute__((tls_model("initial-exec")));

static int thread_guarded(void) {
  if (!thread_prefixes[0] || thread_state == 1) return thread_state == 1;
  if (thread_state == 2 && (++thread_calls & 4095)) return 0;
  char name[17] = {0};
  prctl(PR_GET_NAME, name, 0, 0, 0);
  thread_state = 2;
  for (const char *q = thread_prefixes; *q; q += strlen(q) + 1)
    if (strncmp(name, q, strlen(q)) == 0) thread_state = 1;
  return thread_state == 1;
}

// dlsym may allocate: its calls are served from here while the real functions are looked up
static int looking_up;
static char boot[65536];
static size_t boot_used;

static int from_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }

static void *boot_alloc(size_t size) {
  void *p = boot + boot_used;
  boot_used += (size + 15) & ~(size_t)15;
  return p;
}

static void init(void) {
  if (real_free || looking_up) return;
  looking_up = 1;
  real_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_free = dlsym(RTLD_NEXT, "free");
  const char *v;
  if ((v = getenv("GUARD_MIN"))) memalign_min = strtoul(v, 0, 10);
  if ((v = getenv("GUARD_MALLOC_MIN"))) malloc_min = strtoul(v, 0, 10);
  under = getenv("GUARD_UNDER") != 0;
  if ((v = getenv("GUARD_THREADS"))) {
    strncpy(thread_prefixes, v, sizeof thread_prefixes - 2);
    for (char *c = thread_prefixes; *c; c++)
      if (*c == ',') *c = 0;
  }
  looking_up = 0;
}

static unsigned slot_of(uintptr_t p) { return (unsigned)((p >> 4) * 2654435761u) & (SLOTS - 1); }

static void insert(block_t b) {
  unsigned i = slot_of(b.ptr);
  while (table[i].ptr) i = (i + 1) & (SLOTS - 1);
  table[i] = b;
}

static unsigned find(uintptr_t p) {
  unsigned i = slot_of(p);
  while (table[i].ptr && table[i].ptr != p) i = (i + 1) & (SLOTS - 1);
  return i;
}

static void erase(unsigned i) {  // linear probing's backward-shift deletion
  unsigned j = i;
  for (;;) {
    table[i].ptr = 0;
    for (;;) {
      j = (j + 1) & (SLOTS - 1);
      if (!table[j].ptr) return;
      unsigned k = slot_of(table[j].ptr);
      if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) break;
    }
    table[i] = table[j];
    i = j;
  }
}

// a block of its own pages beside an inaccessible one; -1 when it cannot be had
static int guarded(void **out, size_t align, size_t size) {
  if (size == 0 || align > PAGE || live >= LIVE_LIMIT) return -1;
  size_t n = (size + align - 1) / align * align;
  size_t pages = (n + PAGE - 1) / PAGE;
  size_t len = (pages + 1) * PAGE;
  void *base = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return -1;
  uintptr_t guard = under ? (uintptr_t)base : (uintptr_t)base + pages * PAGE;
  mprotect((void *)guard, PAGE, PROT_NONE);
  uintptr_t p = under ? (uintptr_t)base + PAGE : guard - n;
  pthread_mutex_lock(&lock);
  insert((block_t){p, (uintptr_t)base, len, size});
  live++;
  pthread_mutex_unlock(&lock);
  *out = (void *)p;
  return 0;
}

int posix_memalign(void **out, size_t align, size_t size) {
  init();
  if ((size < memalign_min && !thread_guarded()) || guarded(out, align, size) != 0)
    return real_memalign(out, align, size);
  return 0;
}

void *malloc(size_t size) {
  if (looking_up) return boot_alloc(size);
  init();
  void *p;
  if ((size >= malloc_min || thread_guarded()) && guarded(&p, 16, size) == 0) return p;
  return real_malloc(size);
}

void *calloc(size_t n, size_t size) {
  if (looking_up) return memset(boot_alloc(n * size), 0, n * size);
  init();
  void *p;
  if ((n * size >= malloc_min || thread_guarded()) && guarded(&p, 16, n * size) == 0)
    return p;  // mmap zeroes
  return real_calloc(n, size);
}

void free(void *p) {
  if (!p || from_boot(p)) return;
  init();
  pthread_mutex_lock(&lock);
  unsigned i = find((uintptr_t)p);
  int mine = table[i].ptr != 0;
  if (mine) {
    block_t b = table[i];
    erase(i);
    live--;
    mprotect((void *)b.base, b.len, PROT_NONE);
    if (held_count == QUARANTINE) {  // the oldest freed block's pages go back
      munmap((void *)held[held_first].base, held[held_first].len);
      held_first = (held_first + 1) % QUARANTINE;
      held_count--;
    }
    unsigned last = (held_first + held_count++) % QUARANTINE;
    held[last].base = b.base;
    held[last].len = b.len;
  }
  pthread_mutex_unlock(&lock);
  if (!mine) real_free(p);
}

void *realloc(void *p, size_t size) {
  init();
  size_t old = 0;
  if (p && from_boot(p)) {
    old = (size_t)(boot + sizeof boot - (char *)p);  // dlsym's: at most the rest of boot
  } else if (p) {
    pthread_mutex_lock(&lock);
    unsigned i = find((uintptr_t)p);
    old = table[i].ptr ? table[i].size : 0;
    pthread_mutex_unlock(&lock);
    if (!old) return real_realloc(p, size);
  } else {
    return malloc(size);
  }
  void *q = malloc(size);
  if (q) {
    memcpy(q, p, old < size ? old : size);
    free(p);
  }
  return q;
}
