/*
 * A fake libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * pynvml loads it through its normal loader (CDLL("libnvidia-ml.so.1") found via
 * LD_LIBRARY_PATH), so the exporter's real pynvml code path runs against it. What it
 * reports comes from the key=value file named by FAKE_NVML_CONFIG, re-read on every
 * nvmlInit and every nvmlDeviceGetCount_v2:
 *
 *   init_error=9                 return this from nvmlInitWithFlags (9: driver not loaded)
 *   driver=550.54.15
 *   count=2
 *   hang_file=/tmp/x             while this file exists, nvmlDeviceGetCount_v2 blocks
 *   hang_holds_shutdown=1        nvmlShutdown waits for every call in the hang (a driver lock)
 *   count_delay_ms=1500          nvmlDeviceGetCount_v2 answers this late (a slow driver)
 *   count_error=15               nvmlDeviceGetCount_v2 returns this (15: GPU is lost)
 *   stats_file=/tmp/stats        "<calls in the hang now> <most at once> <inits> <shutdowns>"
 *   gpu0.name=NVIDIA H100 80GB HBM3
 *   gpu0.uuid=GPU-...
 *   gpu0.total= / gpu0.used= / gpu0.free= / gpu0.reserved=   bytes
 *   gpu0.v2=0                    memory info v2 -> NOT_SUPPORTED (older driver)
 *   gpu0.lost=1                  every per-device call -> GPU_IS_LOST
 *   gpu0.procs=1234:1048576,99:5 compute processes, pid:bytes
 *   gpu0.mig=2                   MIG on, two MIG devices: gpu0.mig0.total= ... (as above)
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define OK 0
#define ERR_UNINITIALIZED 1
#define ERR_INVALID_ARGUMENT 2
#define ERR_NOT_SUPPORTED 3
#define ERR_NOT_FOUND 6
#define ERR_INSUFFICIENT_SIZE 7
#define ERR_GPU_IS_LOST 15

typedef struct { unsigned long long total, free, used; } mem_v1_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } mem_v2_t;
typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } proc_t;

#define MAX_KEYS 256
static char keys[MAX_KEYS][64], values[MAX_KEYS][256];
static int nkeys;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int hanging, most_hanging, inits, shutdowns, initialised;

static void load(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    char line[400];
    FILE *f = path ? fopen(path, "r") : NULL;
    pthread_mutex_lock(&lock);
    nkeys = 0;
    while (f && fgets(line, sizeof line, f) && nkeys < MAX_KEYS) {
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        line[strcspn(line, "\n")] = 0;
        eq[1 + strcspn(eq + 1, "\n")] = 0;
        snprintf(keys[nkeys], sizeof keys[0], "%s", line);
        snprintf(values[nkeys], sizeof values[0], "%s", eq + 1);
        nkeys++;
    }
    pthread_mutex_unlock(&lock);
    if (f) fclose(f);
}

static const char *get(const char *key, const char *fallback) {
    for (int i = 0; i < nkeys; i++)
        if (!strcmp(keys[i], key)) return values[i];
    return fallback;
}

static const char *dev(long h, const char *field, const char *fallback) {
    char key[64];
    if (h >= 1000) snprintf(key, sizeof key, "gpu%ld.mig%ld.%s", h / 1000 - 1, h % 1000, field);
    else snprintf(key, sizeof key, "gpu%ld.%s", h - 1, field);
    return get(key, fallback);
}

static unsigned long long num(long h, const char *field) { return strtoull(dev(h, field, "0"), NULL, 10); }

static void write_stats(void) {
    const char *path = get("stats_file", NULL);
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f) return;
    fprintf(f, "%d %d %d %d\n", hanging, most_hanging, inits, shutdowns);
    fclose(f);
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    load();
    int err = atoi(get("init_error", "0"));
    if (err) return err;
    pthread_mutex_lock(&lock);
    initialised = 1;
    inits++;
    write_stats();
    pthread_mutex_unlock(&lock);
    return OK;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) {
    load();
    if (atoi(get("hang_holds_shutdown", "0")))
        while (hanging) usleep(20000);
    pthread_mutex_lock(&lock);
    initialised = 0;
    shutdowns++;
    write_stats();
    pthread_mutex_unlock(&lock);
    return OK;
}
const char *nvmlErrorString(int result) { (void)result; return "fake NVML error"; }

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    snprintf(version, length, "%s", get("driver", "550.54.15"));
    return OK;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return ERR_UNINITIALIZED;
    load();
    const char *hang = get("hang_file", NULL);
    if (hang && access(hang, F_OK) == 0) {
        pthread_mutex_lock(&lock);
        hanging++;
        if (hanging > most_hanging) most_hanging = hanging;
        write_stats();
        pthread_mutex_unlock(&lock);
        while (access(hang, F_OK) == 0) usleep(20000); /* a GPU fallen off the bus */
        pthread_mutex_lock(&lock);
        hanging--;
        write_stats();
        pthread_mutex_unlock(&lock);
    }
    usleep(1000 * (useconds_t)atoi(get("count_delay_ms", "0")));
    int err = atoi(get("count_error", "0"));
    if (err) return err;
    *count = (unsigned)atoi(get("count", "0"));
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if (index >= (unsigned)atoi(get("count", "0"))) return ERR_INVALID_ARGUMENT;
    *device = (void *)(long)(index + 1);
    return OK;
}

#define LOST_CHECK(h) if (atoi(dev((h) >= 1000 ? (h) / 1000 : (h), "lost", "0"))) return ERR_GPU_IS_LOST

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    long h = (long)device;
    LOST_CHECK(h);
    snprintf(name, length, "%s", dev(h, "name", "Fake GPU"));
    return OK;
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    long h = (long)device;
    LOST_CHECK(h);
    snprintf(uuid, length, "%s", dev(h, "uuid", "GPU-00000000-0000-0000-0000-000000000000"));
    return OK;
}

int nvmlDeviceGetMemoryInfo(void *device, mem_v1_t *memory) {
    long h = (long)device;
    LOST_CHECK(h);
    memory->total = num(h, "total");
    memory->free = num(h, "free");
    /* As the driver does: v1's used counts the memory the driver reserves, which v2 splits
       out as reserved (gpu0.used= is v2's). */
    memory->used = num(h, "used") + num(h, "reserved");
    return OK;
}

int nvmlDeviceGetMemoryInfo_v2(void *device, mem_v2_t *memory) {
    long h = (long)device;
    LOST_CHECK(h);
    if (!atoi(dev(h >= 1000 ? h / 1000 : h, "v2", "1"))) return ERR_NOT_SUPPORTED;
    if (memory->version != 0x02000028) return 25; /* ARGUMENT_VERSION_MISMATCH */
    memory->total = num(h, "total");
    memory->reserved = num(h, "reserved");
    memory->free = num(h, "free");
    memory->used = num(h, "used");
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, proc_t *infos) {
    long h = (long)device;
    LOST_CHECK(h);
    char list[256];
    snprintf(list, sizeof list, "%s", dev(h, "procs", ""));
    proc_t found[32];
    unsigned n = 0;
    for (char *item = strtok(list, ","); item && n < 32; item = strtok(NULL, ",")) {
        unsigned pid;
        unsigned long long used;
        if (sscanf(item, "%u:%llu", &pid, &used) == 2) {
            found[n].pid = pid;
            found[n].used = used;
            found[n].gi = found[n].ci = 0xFFFFFFFF;
            n++;
        }
    }
    if (n == 0) { *count = 0; return OK; }
    if (!infos || *count < n) { *count = n; return ERR_INSUFFICIENT_SIZE; }
    memcpy(infos, found, n * sizeof(proc_t));
    *count = n;
    return OK;
}

int nvmlDeviceGetGraphicsRunningProcesses_v3(void *device, unsigned int *count, proc_t *infos) {
    (void)device; (void)count; (void)infos;
    return ERR_NOT_SUPPORTED; /* as on most data-centre GPUs */
}

int nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    long h = (long)device;
    LOST_CHECK(h);
    if (!atoi(dev(h, "mig", "0"))) return ERR_NOT_SUPPORTED;
    *current = *pending = 1;
    return OK;
}

int nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned int *count) {
    *count = (unsigned)atoi(dev((long)device, "mig", "0"));
    return OK;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig) {
    long h = (long)device;
    if (index >= (unsigned)atoi(dev(h, "mig", "0"))) return ERR_NOT_FOUND;
    *mig = (void *)(h * 1000 + index);
    return OK;
}
