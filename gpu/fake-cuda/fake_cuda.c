/*
 * A FAKE libcuda.so for testing vovp's GPU code paths on machines without an NVIDIA GPU.
 *
 * It is a stand-in for the driver, NOT a model of a GPU: "device memory" is shared host memory
 * (one memfd per cuMemAlloc), copies are memcpy/memmove, streams do nothing, and CUDA IPC is
 * emulated by opening the exporting process's memfd through /proc/<pid>/fd/<fd> (so the
 * importing process must be allowed to read that: same uid, or root). Passing tests with it
 * proves the store's logic (pools, handles, offsets, references, eviction, the client and CLI
 * paths across processes); it proves nothing about real hardware, drivers or bandwidth.
 *
 * Build:  gcc -shared -fPIC -O2 -Wall -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_cuda.c -lpthread
 * (scripts/gpu-fake-test.sh does this into target/fake-cuda/ and runs the GPU tests with it).
 *
 * Failure modes, for the "no GPU" paths: FAKE_CUDA_INIT_ERROR=100 makes cuInit fail with that code
 * (100 = CUDA_ERROR_NO_DEVICE); FAKE_CUDA_DEVICES=0 reports no device.
 *
 * One device, "Fake GPU 0", 16 GiB total, 8 GiB free, driver version 12.8. Only the entry points
 * vovp-gpu uses are implemented (plus a few synchronous copies the cross-process tests use).
 * Pointers are checked against the live allocations, so a bad pointer is an error
 * (CUDA_ERROR_INVALID_VALUE), not a crash.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
typedef int CUresult;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
};

#define MAX_ENTRIES 4096
#define FAKE_TOTAL (16ull << 30)
#define FAKE_FREE (8ull << 30)
#define MAX_ALLOC (12ull << 30)
/* cuPointerGetAttribute attribute: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
#define ATTR_DEVICE_ORDINAL 9
/* cuIpcOpenMemHandle flag: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
#define IPC_LAZY_PEER 1

/* An allocation (fd >= 0, made here) or an IPC mapping of another process's allocation (fd -1). */
struct entry { CUdeviceptr p; size_t n; int fd; int used; };
static struct entry table[MAX_ENTRIES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread void *current_ctx = 0;

/* What the 64-byte IPC handle carries. */
struct wire { int pid; int fd; unsigned long long n; };

static struct entry *find_base(CUdeviceptr p) {
    for (int i = 0; i < MAX_ENTRIES; i++)
        if (table[i].used && table[i].p == p) return &table[i];
    return 0;
}

/* True when [p, p+n) lies inside one live allocation or mapping. */
static int valid_range(CUdeviceptr p, size_t n) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ENTRIES && !ok; i++)
        if (table[i].used && p >= table[i].p && n <= table[i].n && p - table[i].p <= table[i].n - n)
            ok = 1;
    pthread_mutex_unlock(&lock);
    return ok;
}

static struct entry *free_slot(void) {
    for (int i = 0; i < MAX_ENTRIES; i++)
        if (!table[i].used) return &table[i];
    return 0;
}

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

CUresult cuInit(unsigned flags) { (void)flags; return env_int("FAKE_CUDA_INIT_ERROR", SUCCESS); }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = env_int("FAKE_CUDA_DEVICES", 1) > 0 ? 1 : 0; return SUCCESS; }
CUresult cuDeviceGet(int *d, int ordinal) {
    int n;
    cuDeviceGetCount(&n);
    if (ordinal < 0 || ordinal >= n) return INVALID_DEVICE;
    *d = ordinal;
    return SUCCESS;
}
CUresult cuDeviceGetName(char *buf, int len, int dev) {
    snprintf(buf, (size_t)len, "Fake GPU %d", dev);
    return SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    *ctx = (void *)(0x1000 + (long)dev);
    return SUCCESS;
}
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return SUCCESS; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return SUCCESS; }
CUresult cuCtxSynchronize(void) { return current_ctx ? SUCCESS : INVALID_CONTEXT; }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!current_ctx) return INVALID_CONTEXT;
    *free_bytes = FAKE_FREE;
    *total = FAKE_TOTAL;
    return SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (!current_ctx) return INVALID_CONTEXT;
    if (n == 0) return INVALID_VALUE;
    if (n > MAX_ALLOC) return OUT_OF_MEMORY;
    int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)n) != 0) { close(fd); return OUT_OF_MEMORY; }
    void *m = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return OUT_OF_MEMORY; }
    pthread_mutex_lock(&lock);
    struct entry *e = free_slot();
    if (e) { e->p = (CUdeviceptr)m; e->n = n; e->fd = fd; e->used = 1; }
    pthread_mutex_unlock(&lock);
    if (!e) { munmap(m, n); close(fd); return OUT_OF_MEMORY; }
    *p = (CUdeviceptr)m;
    return SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct entry *e = find_base(p);
    if (!e || e->fd < 0) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
    munmap((void *)p, e->n);
    close(e->fd);
    e->used = 0;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *n, CUdeviceptr p) {
    CUresult rc = INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ENTRIES; i++)
        if (table[i].used && p >= table[i].p && p < table[i].p + table[i].n) {
            if (base) *base = table[i].p;
            if (n) *n = table[i].n;
            rc = SUCCESS;
            break;
        }
    pthread_mutex_unlock(&lock);
    return rc;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct entry *e = find_base(p);
    struct wire w = { getpid(), e ? e->fd : -1, e ? (unsigned long long)e->n : 0 };
    pthread_mutex_unlock(&lock);
    if (!e || w.fd < 0) return INVALID_VALUE;
    memset(h, 0, sizeof *h);
    memcpy(h, &w, sizeof w);
    return SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    struct wire w;
    memcpy(&w, &h, sizeof w);
    if (!current_ctx) return INVALID_CONTEXT;
    /* The real driver refuses a process's own handles too. */
    if (w.pid == getpid()) return INVALID_CONTEXT;
    if (flags != IPC_LAZY_PEER || w.pid <= 0 || w.fd < 0 || w.n == 0) return INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_HANDLE;
    void *m = mmap(0, (size_t)w.n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct entry *e = free_slot();
    if (e) { e->p = (CUdeviceptr)m; e->n = (size_t)w.n; e->fd = -1; e->used = 1; }
    pthread_mutex_unlock(&lock);
    if (!e) { munmap(m, (size_t)w.n); return OUT_OF_MEMORY; }
    *p = (CUdeviceptr)m;
    return SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct entry *e = find_base(p);
    if (!e || e->fd != -1) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
    munmap((void *)p, e->n);
    e->used = 0;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    if (!current_ctx) return INVALID_CONTEXT;
    if (attr != ATTR_DEVICE_ORDINAL || !valid_range(p, 1)) return INVALID_VALUE;
    *(int *)data = 0;
    return SUCCESS;
}

CUresult cuStreamCreate(void **s, unsigned flags) {
    (void)flags;
    if (!current_ctx) return INVALID_CONTEXT;
    *s = (void *)1;
    return SUCCESS;
}
CUresult cuStreamSynchronize(void *s) { (void)s; return SUCCESS; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return SUCCESS; }

static CUresult d2d(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (!current_ctx) return INVALID_CONTEXT;
    if (!valid_range(dst, n) || !valid_range(src, n)) return INVALID_VALUE;
    memmove((void *)dst, (const void *)src, n);
    return SUCCESS;
}
static CUresult h2d(CUdeviceptr dst, const void *src, size_t n) {
    if (!current_ctx) return INVALID_CONTEXT;
    if (!valid_range(dst, n)) return INVALID_VALUE;
    memcpy((void *)dst, src, n);
    return SUCCESS;
}
static CUresult d2h(void *dst, CUdeviceptr src, size_t n) {
    if (!current_ctx) return INVALID_CONTEXT;
    if (!valid_range(src, n)) return INVALID_VALUE;
    memcpy(dst, (const void *)src, n);
    return SUCCESS;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { (void)st; return d2d(d, s, n); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { (void)st; return h2d(d, s, n); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { (void)st; return d2h(d, s, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return d2d(d, s, n); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { return h2d(d, s, n); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { return d2h(d, s, n); }

static const char *const messages[][3] = {
    { "0", "CUDA_SUCCESS", "no error" },
    { "1", "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
    { "2", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory" },
    { "100", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
    { "101", "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal" },
    { "201", "CUDA_ERROR_INVALID_CONTEXT", "invalid device context" },
    { "400", "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle" },
};

static CUresult message(CUresult e, int which, const char **s) {
    for (size_t i = 0; i < sizeof messages / sizeof messages[0]; i++)
        if (atoi(messages[i][0]) == e) { *s = messages[i][which]; return SUCCESS; }
    *s = 0;
    return INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult e, const char **s) { return message(e, 1, s); }
CUresult cuGetErrorString(CUresult e, const char **s) { return message(e, 2, s); }
