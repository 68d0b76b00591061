/* The kernels' threads: see team.h for the policy. Helpers are the host's OpenMP threads where
 * the binding installs that runtime (deltarule_use_host_threads), else threads kept here. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "team.h"

/* A caller's wait for its helpers longer than its own work and than this is a stall: a helper
 * the scheduler did not run (it waits for a quantum: 1.5 ms and more, 4-12 ms on the loaded
 * 2-core VM). Shorter waits are wake-ups: a helper that slept arrives ~30 us after the signal,
 * or 0.3-0.5 ms when its idle vCPU must be woken first (the first call after a 20 ms pause on
 * that VM, quiet: 0.25 ms made those stalls). Longer wake-ups (the VM's hypervisor; 1 pause in 6
 * there) come far apart: accidents, below. Calls far apart are judged too: in a model, torch's
 * GEMMs run between them on the same threads. */
#define STALL_MIN_NS 1000000
/* A stall that comes within PROBE_STEPS of parallel small work (state-element steps, as
 * team_size counts them) after the last one is a close one; the second close stall in a row
 * means the machine is contended: small calls then run alone for a period, this long and this
 * many of them (both), doubled for every further close stall, up to SOLO_MAX_NS and
 * SOLO_MAX_CALLS. A stall after more work is an accident, and starts over. Why work, not calls:
 * a stall costs 4-12 ms on a loaded 2-core VM, and a call's second thread saves time in
 * proportion to its work (B = 1 16-head decode, 2^18 steps: ~40 us; B = 8: ~300 us), so
 * parallel calls break even where a stall comes once per ~2^25 steps of them. Running alone
 * makes every call slower where stalls make a few slow: PROBE_STEPS is 2^24 (64 B = 1 decodes,
 * 8 B = 8 ones), and one close stall is not enough. On that VM, quiet, 1 in 150 calls took over
 * 1 ms: with every stall starting a period, or a bound of 2^25 steps, decode ran alone most of
 * the time; an exemption for calls more than 2 ms after the last parallel one missed a model's
 * stalls (torch's layers between its calls). A first period of 10 ms paid a stall per probe
 * more than it won back; calls far apart (a GEMM between) need the count. Under a constant load
 * this costs a few stalls per period. (Quiet float32 B = 8 decode is still slower in the bench
 * after this change: docs/performance.md, "Busy machines".) */
#define PROBE_STEPS (1LL << 24)
#define SOLO_MIN_NS 100000000LL
#define SOLO_MAX_NS 2000000000LL
#define SOLO_MIN_CALLS 64
#define SOLO_MAX_CALLS 4096
/* While contended, a call takes one thread per this many steps: 2^26 state-element updates take
 * ~20 ms on one AVX2 core, several stalls' worth (B = 1 16-head decode is 2^18: alone; a 4k
 * prefill, 2^30: both threads, as a stall is small beside it) */
#define CONTENDED_STEPS_PER_THREAD (1LL << 26)

static inline int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void spin_pause(void)
{
#if defined(__SSE2__)
    _mm_pause();
#endif
}

/* ---- the policy ---- */

/* Calls are judged by size class (steps < 2^20, 2^22, 2^24, more): a period that the stalls of
 * one size started does not carry over to calls of another (a model's layers are one size; in
 * `deltarule bench` B = 1 decode's periods ran on into the B = 8 case's timing) */
#define CLASSES 4
typedef struct {
    atomic_llong solo_until;         /* the class's calls run alone until then (ns) */
    atomic_llong period;             /* the last solo period (ns) */
    atomic_llong calls;              /* calls left to run alone */
    atomic_llong probes;             /* steps of the class's calls run in parallel since its last stall */
    atomic_int close;                /* close stalls in a row */
} size_class;

static struct {
    atomic_int adapt;                /* 0: every call gets its threads, stalls are not looked for */
    atomic_llong stalls;             /* stalls seen since the adaptation started */
    size_class of[CLASSES];
} contention = {.adapt = 1};

static size_class *class_of(int64_t steps)
{
    int c = 0;
    while (c + 1 < CLASSES && steps >= (1LL << (20 + 2 * c)))
        c++;
    return &contention.of[c];
}

/* Turns the adaptation on or off (deltarule_team_adapt(0): a machine whose cores are the
 * process's own; tests that must run every call on its threads); either way from a clean state.
 * Returns the previous setting. */
int deltarule_team_adapt(int on)
{
    const int was = atomic_exchange(&contention.adapt, 0);
    for (int c = 0; c < CLASSES; c++) {
        size_class *k = &contention.of[c];
        atomic_store(&k->solo_until, 0);
        atomic_store(&k->period, 0);
        atomic_store(&k->calls, 0);
        atomic_store(&k->probes, 0);
        atomic_store(&k->close, 0);
    }
    atomic_store(&contention.stalls, 0);
    atomic_store(&contention.adapt, on != 0);
    return was;
}

int team_size(int threads, int64_t steps)
{
    if (threads < 2)
        return 1;
    const int64_t fit = steps / CONTENDED_STEPS_PER_THREAD;
    if (fit >= threads || !atomic_load_explicit(&contention.adapt, memory_order_relaxed))
        return threads;
    size_class *k = class_of(steps);
    if (atomic_load_explicit(&k->calls, memory_order_relaxed) > 0)
        atomic_fetch_sub_explicit(&k->calls, 1, memory_order_relaxed);
    else if (atomic_load_explicit(&k->solo_until, memory_order_relaxed) <= now_ns()) {
        atomic_fetch_add_explicit(&k->probes, steps, memory_order_relaxed);
        return threads;
    }
    return fit > 1 ? (int)fit : 1;
}

/* The small calls a solo period of `period` ns covers */
static int64_t solo_calls(int64_t period)
{
    const int64_t calls = SOLO_MIN_CALLS * (period / SOLO_MIN_NS);
    return calls < SOLO_MAX_CALLS ? calls : SOLO_MAX_CALLS;
}

/* A parallel call of `steps` began at `start`, the caller worked from `begun` to `done`, the call ended at
 * `end`: the rest is waiting (OpenMP waits at a region's start for threads to dock, and at its
 * end for them to arrive) */
static void note_wait(int64_t steps, int64_t start, int64_t begun, int64_t done, int64_t end)
{
    const int64_t wait = (end - done) + (begun - start);
    if (wait < STALL_MIN_NS || wait <= done - begun || !atomic_load(&contention.adapt))
        return;
    atomic_fetch_add(&contention.stalls, 1);
    size_class *k = class_of(steps);
    if (atomic_exchange(&k->probes, 0) >= PROBE_STEPS) {
        atomic_store(&k->close, 0);
        atomic_store(&k->period, 0);
        return;
    }
    if (atomic_fetch_add(&k->close, 1) < 1)
        return;
    const int64_t was = atomic_load(&k->period);
    const int64_t period = !was ? SOLO_MIN_NS : 2 * was < SOLO_MAX_NS ? 2 * was : SOLO_MAX_NS;
    atomic_store(&k->period, period);
    atomic_store(&k->calls, solo_calls(period));
    atomic_store(&k->solo_until, end + period);
}

/* For tests and the benchmark: [stalls seen, ns left of the solo period, the period, small calls
 * left to run alone, helpers that arrived while held (deltarule_team_hold)] */
static atomic_llong held_arrivals;

void deltarule_team_state(int64_t *out)
{
    const int64_t now = now_ns();
    out[0] = atomic_load(&contention.stalls);
    out[1] = out[2] = out[3] = 0;
    for (int c = 0; c < CLASSES; c++) {             /* the longest of the classes' */
        size_class *k = &contention.of[c];
        const int64_t left = atomic_load(&k->solo_until) - now, period = atomic_load(&k->period);
        const int64_t calls = atomic_load(&k->calls);
        out[1] = left > out[1] ? left : out[1];
        out[2] = period > out[2] ? period : out[2];
        out[3] = calls > out[3] ? calls : out[3];
    }
    out[4] = atomic_load(&held_arrivals);
}

/* For tests: helpers whose bit (1 << me) is set in the mask do not take part until it is
 * cleared, as a helper the scheduler does not run (checked where a helper arrives at a call) */
static atomic_uint held;

void deltarule_team_hold(unsigned mask)
{
    atomic_store(&held, mask);
}

static void wait_while_held(int me)
{
    if (__builtin_expect(atomic_load_explicit(&held, memory_order_relaxed) != 0, 0)) {
        const struct timespec nap = {0, 100000};
        if (atomic_load(&held) & (1u << me))
            atomic_fetch_add(&held_arrivals, 1);
        while (atomic_load(&held) & (1u << me))
            nanosleep(&nap, NULL);
    }
}

/* ---- scratch memory ---- */

static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;
static __thread struct {
    void *mem;
    size_t bytes;
} kept;

static void kept_init(void)
{
    pthread_key_create(&kept_key, free);
}

void *team_scratch(size_t bytes)
{
    if (kept.bytes < bytes) {
        pthread_once(&kept_once, kept_init);
        free(kept.mem);
        kept.mem = aligned_alloc(64, bytes);
        kept.bytes = kept.mem ? bytes : 0;
        pthread_setspecific(kept_key, kept.mem);
    }
    return kept.mem;
}

/* ---- the host's OpenMP runtime ---- */

typedef void (*host_parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
typedef int (*host_thread_num_fn)(void);

static host_parallel_fn installed_parallel;
static host_thread_num_fn installed_thread_num;

/* Installs (or with NULLs removes) the host's OpenMP runtime: its GOMP_parallel and
 * omp_get_thread_num (libgomp's ABI, which LLVM's and Intel's runtimes export as well).
 * Not while a kernel call runs. */
void deltarule_use_host_threads(void *parallel, void *thread_num)
{
    __atomic_store_n(&installed_thread_num, (host_thread_num_fn)thread_num, __ATOMIC_SEQ_CST);
    __atomic_store_n(&installed_parallel, (host_parallel_fn)(thread_num ? parallel : NULL), __ATOMIC_SEQ_CST);
}

typedef struct {
    team_work_fn work;
    void *job;
    int64_t begun, done;             /* when thread 0 (the caller) began and finished its work */
} region;

static void host_region(void *arg)
{
    region *r = arg;
    const int me = __atomic_load_n(&installed_thread_num, __ATOMIC_ACQUIRE)();
    if (me) {
        wait_while_held(me);
        r->work(r->job, me);
    } else {
        r->begun = now_ns();
        r->work(r->job, 0);
        r->done = now_ns();
    }
}

/* ---- the own helpers ----
 * Kept between calls (creating a thread costs tens of microseconds). On these VMs a wake-up is
 * slow: the signal costs the caller ~10 us and the helper arrives ~15-30 us later (an idle vCPU
 * is woken), a large part of a B = 1 decode (~30 us of tasks on two threads). So a helper that
 * finishes a call spins a while, watching for the next one, before it blocks, and the caller
 * signals only helpers that sleep. How long: twice the recent gap between calls (an average the
 * caller keeps), when that is under HELPER_SPIN_NS, else not at all: calls back to back find
 * their helpers awake, while a helper never spins through the torch work between calls that
 * are far apart. Once the calling thread finds no task left it closes the call, a helper that
 * arrives later stays out, and the caller waits only for those that joined, spinning up to
 * JOIN_SPIN_NS for their last task before it blocks (being woken would cost it another ~15 us).
 * One call at a time uses them; a concurrent call runs on its own thread alone. A forked child
 * starts with none. */
#define JOIN_SPIN_NS 50000
#define HELPER_SPIN_NS 50000
static struct {
    pthread_mutex_t busy;            /* held by the call that uses the helpers */
    pthread_mutex_t m;
    pthread_cond_t go, done;
    int started;                     /* helper threads alive */
    int wanted;                      /* helpers asked to join this call */
    atomic_int active;               /* helpers working on it (changed under m) */
    int open;                        /* the call still takes helpers */
    int sleeping;                    /* helpers blocked on go (changed under m) */
    int64_t last_end;                /* when the last call with helpers ended (ns; under busy) */
    atomic_llong gap;                /* the recent gap between such calls (ns, an average) */
    atomic_long generation;          /* bumped per call (under m; spinning helpers read it without) */
    team_work_fn work;
    void *job;
} team;
static pthread_once_t team_once = PTHREAD_ONCE_INIT;

static void team_reset(void)
{
    pthread_mutex_init(&team.busy, NULL);
    pthread_mutex_init(&team.m, NULL);
    pthread_cond_init(&team.go, NULL);
    pthread_cond_init(&team.done, NULL);
    team.started = team.wanted = team.open = team.sleeping = 0;
    team.last_end = 0;
    atomic_init(&team.gap, HELPER_SPIN_NS);
    atomic_init(&team.active, 0);
    atomic_init(&team.generation, 0);
    team.work = NULL;
    team.job = NULL;
}

static void team_init(void)
{
    team_reset();
    pthread_atfork(NULL, NULL, team_reset);
}

static void *helper(void *arg)
{
    const int id = (int)(intptr_t)arg;
    long seen = 0;
    pthread_mutex_lock(&team.m);
    for (;;) {
        const int64_t gap = atomic_load(&team.gap);
        if (atomic_load(&team.generation) == seen && gap < HELPER_SPIN_NS) {  /* spin for the next call */
            pthread_mutex_unlock(&team.m);
            const int64_t t0 = now_ns();
            do
                for (int i = 0; i < 64 && atomic_load_explicit(&team.generation, memory_order_relaxed) == seen; i++)
                    spin_pause();
            while (atomic_load(&team.generation) == seen && now_ns() - t0 < 2 * gap);
            pthread_mutex_lock(&team.m);
        }
        while (atomic_load(&team.generation) == seen) {
            team.sleeping++;
            pthread_cond_wait(&team.go, &team.m);
            team.sleeping--;
        }
        seen = atomic_load(&team.generation);
        if (atomic_load_explicit(&held, memory_order_relaxed)) {
            pthread_mutex_unlock(&team.m);
            wait_while_held(id + 1);
            pthread_mutex_lock(&team.m);
        }
        if (id < team.wanted && team.open && seen == atomic_load(&team.generation)) {
            team.active++;
            pthread_mutex_unlock(&team.m);
            team.work(team.job, id + 1);
            pthread_mutex_lock(&team.m);
            if (--team.active == 0 && !team.open)
                pthread_cond_signal(&team.done);
        }
    }
    return NULL;
}

static void own_run(team_work_fn work, void *job, int threads, int64_t steps)
{
    const int64_t start = now_ns();
    if (team.last_end) {             /* the recent gap between calls: how long helpers spin */
        const int64_t gap = start - team.last_end, was = atomic_load(&team.gap);
        atomic_store(&team.gap, (3 * was + (gap < 10 * HELPER_SPIN_NS ? gap : 10 * HELPER_SPIN_NS)) / 4);
    }
    pthread_mutex_lock(&team.m);
    for (; team.started < threads - 1; team.started++) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int fail = pthread_create(&id, &attr, helper, (void *)(intptr_t)team.started);
        pthread_attr_destroy(&attr);
        if (fail)
            break;
    }
    team.wanted = threads - 1 < team.started ? threads - 1 : team.started;
    team.open = 1;
    team.work = work;
    team.job = job;
    atomic_fetch_add(&team.generation, 1);
    if (team.sleeping)               /* the spinning ones see the generation */
        pthread_cond_broadcast(&team.go);
    pthread_mutex_unlock(&team.m);
    const int64_t begun = now_ns();
    work(job, 0);
    const int64_t done = now_ns();
    pthread_mutex_lock(&team.m);
    team.open = 0;                   /* every task is taken: a helper still on its way stays out */
    pthread_mutex_unlock(&team.m);
    for (int64_t t0 = now_ns(); atomic_load(&team.active) > 0 && now_ns() - t0 < JOIN_SPIN_NS;)
        for (int i = 0; i < 64 && atomic_load(&team.active) > 0; i++)
            spin_pause();
    pthread_mutex_lock(&team.m);
    while (team.active > 0)
        pthread_cond_wait(&team.done, &team.m);
    pthread_mutex_unlock(&team.m);
    team.last_end = now_ns();
    note_wait(steps, start, begun, done, team.last_end);
}

void team_run(team_work_fn work, void *job, int threads, int64_t steps)
{
    if (threads < 2) {
        work(job, 0);
        return;
    }
    const host_parallel_fn parallel = __atomic_load_n(&installed_parallel, __ATOMIC_ACQUIRE);
    if (parallel) {                  /* the region's threads number 0 (the caller) to threads - 1 */
        region r = {.work = work, .job = job};
        const int64_t start = now_ns();
        parallel(host_region, &r, (unsigned)threads, 0);
        note_wait(steps, start, r.begun, r.done, now_ns());
        return;
    }
    pthread_once(&team_once, team_init);
    if (pthread_mutex_trylock(&team.busy) != 0) {
        work(job, 0);
        return;
    }
    own_run(work, job, threads, steps);
    pthread_mutex_unlock(&team.busy);
}
