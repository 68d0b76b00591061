/* The kernels' threads (team.c): one way for every C kernel (recurrence, conv, backward) to
 * share a call's tasks between the calling thread and helpers, under one policy:
 *
 * - The calling thread works too, and no call waits for a helper that has not arrived: tasks
 *   are taken from shared counters, so any number of threads completes them, and a helper that
 *   arrives after the last task was taken does nothing. On the kernels' own helpers the call
 *   then returns without it; it waits only for tasks a helper took.
 * - Where the host's OpenMP runtime is installed (torch's pool: its threads run the GEMMs
 *   between calls, and a thread of the kernel's own would compete with them), a call is a
 *   parallel region of that runtime, whose start and end wait for every thread of the region,
 *   also one the scheduler has not run yet (a busy machine: a scheduler quantum, milliseconds).
 *   So the team measures each parallel call: when the caller waited, outside its own work,
 *   longer than that work took and longer than STALL_MIN_NS, that is a stall; a second stall
 *   in a row within PROBE_STEPS of parallel work after the last means the machine is
 *   contended, and calls too
 *   small to hide a stall (team_size: below CONTENDED_STEPS_PER_THREAD per thread) run on the
 *   calling thread alone for a period (SOLO_MIN_NS and SOLO_MIN_CALLS, doubling while such
 *   stalls keep coming, up to SOLO_MAX_NS and SOLO_MAX_CALLS), then try their helpers again. The
 *   same holds on the own helpers (a helper preempted with a task in hand).
 */
#ifndef DELTARULE_TEAM_H
#define DELTARULE_TEAM_H

#include <stddef.h>
#include <stdint.h>

/* A call's work as thread `me` runs it (0: the calling thread, 1.. helpers): take tasks from
 * counters in `job` until none is left. Must be correct for any number of threads taking part
 * (1 included) and any order of arrival. */
typedef void (*team_work_fn)(void *job, int me);

/* The threads a call of `steps` units of work (a state element's update by one token, or the
 * kernel's equivalent) gets now: `threads`, or fewer while the machine is contended. */
int team_size(int threads, int64_t steps);

/* Runs work(job, me) on the calling thread (me = 0) and up to threads - 1 helpers (team_size's
 * count for these `steps`); returns once every task taken has finished. */
void team_run(team_work_fn work, void *job, int threads, int64_t steps);

/* The calling thread's scratch memory, at least `bytes` (64-byte aligned), kept for its next
 * call and freed when the thread exits, or NULL (no memory). One per thread, shared by the
 * kernels (calls on a thread do not nest): a fresh allocation of a call's scratch was
 * page-faulted in on every call (helper threads' malloc arenas hand it back), which cost a
 * B = 1 decode ~40 us, and a backward's 4 MB more. */
void *team_scratch(size_t bytes);

#endif
