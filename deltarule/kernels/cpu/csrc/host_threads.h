/* The host process's OpenMP runtime, when the binding installs it (cpu_recurrent.py: the
 * runtime torch's own parallel regions run on, found by the symbols libtorch resolves).
 * A kernel's parallel work then runs as a parallel region of that runtime, on the threads
 * that run torch's GEMMs, instead of on threads of its own beside them: after a parallel
 * region OpenMP workers spin for milliseconds, and a thread of the kernel's own competed
 * with them for the cores (a model's layers alternate the two). The entry points are
 * libgomp's ABI, which LLVM's and Intel's OpenMP runtimes export as well. */
#ifndef DELTARULE_HOST_THREADS_H
#define DELTARULE_HOST_THREADS_H

typedef void (*host_parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
typedef int (*host_thread_num_fn)(void);

/* The installed runtime's GOMP_parallel / omp_get_thread_num, or NULL (own threads) */
host_parallel_fn host_parallel(void);
int host_thread_num(void);

#endif
