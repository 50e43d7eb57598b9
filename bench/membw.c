/* membw: the memory-bandwidth bound for host collectives on this machine.
 *
 *   membw [processes [MiB [rounds]]]      (defaults: 2 processes, 256 MiB each, 10 rounds)
 *
 * Every process copies its own buffer with memcpy (which reads and writes each byte once, with
 * non-temporal stores at these sizes), all of them at the same time; the best aggregate rate over
 * the rounds is the copy bandwidth B (bytes copied per second by the whole machine). A 2-rank
 * all_reduce must read both inputs (2N bytes) and write both outputs (2N), 4N bytes of memory
 * traffic, while B moves 2B bytes of traffic per second: so t >= 2N/B, and its busbw, which
 * for 2 ranks equals N/t, is at most B/2. The program prints B and that bound. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  int procs = argc > 1 ? atoi(argv[1]) : 2;
  size_t bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 256) << 20;
  int rounds = argc > 3 ? atoi(argv[3]) : 10;
  if (procs < 1 || bytes == 0 || rounds < 1) {
    fprintf(stderr, "usage: %s [processes [MiB [rounds]]]\n", argv[0]);
    return 1;
  }
  /* Shared: a start counter per round and each process's elapsed time per round. */
  volatile long* start = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  double* elapsed = mmap(NULL, sizeof(double) * procs * rounds, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  for (int p = 0; p < procs; p++) {
    if (fork() == 0) {
      char* a = malloc(bytes);
      char* b = malloc(bytes);
      memset(a, 1, bytes);
      memset(b, 2, bytes);
      for (int r = 0; r < rounds; r++) {
        __sync_fetch_and_add(&start[r], 1);
        while (start[r] < procs) { /* every process starts the round together */
        }
        double t = now();
        memcpy(b, a, bytes);
        __asm__ volatile("" ::"r"(b) : "memory");
        elapsed[p * rounds + r] = now() - t;
      }
      _exit(0);
    }
  }
  for (int p = 0; p < procs; p++) wait(NULL);
  double best = 0;
  for (int r = 0; r < rounds; r++) {
    double slowest = 0;
    for (int p = 0; p < procs; p++)
      if (elapsed[p * rounds + r] > slowest) slowest = elapsed[p * rounds + r];
    double rate = (double)bytes * procs / slowest;
    if (rate > best) best = rate;
  }
  printf("copy bandwidth, %d processes at once: %.2f GB/s\n", procs, best / 1e9);
  printf("bound on a %d-rank all_reduce's busbw: %.2f GB/s (copy bandwidth / 2)\n", procs, best / 2e9);
  return 0;
}
