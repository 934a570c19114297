/* A kernel timeline recorder for any CUDA program, loaded by the CUDA driver through
 * CUPTI's injection hook: no change to the program, no Nsight Systems needed.
 *
 *   CUDA_INJECTION64_PATH=/path/libpd-cupti-trace.so PD_TRACE_OUT=trace.tsv program ...
 *
 * Records every kernel, memcpy and memset the GPU runs (also the ones inside CUDA graph
 * replays, with their graph and node ids) and, when the program exits, writes them sorted by
 * start time as tab-separated lines:
 *
 *   start_ns  duration_ns  kind  graph_id  graph_node_id  stream  grid  block  name
 *
 * start_ns counts from the first record. PD_TRACE_MAX caps the records kept (default 4M;
 * later ones are counted and dropped). PD_TRACE_API=1 also records the host's CUDA runtime API
 * calls (kind 'R', stream = the calling thread's id, name = the call): on the same clock, they
 * show what the host does between the GPU's work. bench/trace_summary.py turns a trace into per-kernel
 * durations and the gaps between kernels inside a graph replay. */
#include <cupti.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  uint64_t start, end, node;
  uint32_t graph, stream;
  uint32_t grid, block;
  const char *name; /* CUPTI's kernel names live as long as the process */
  char kind;        /* 'K' kernel, 'C' memcpy, 'S' memset, 'R' runtime API call */
  uint8_t copy_kind;
  uint64_t bytes;
} trace_rec;

static trace_rec *g_recs;
static size_t g_n, g_cap, g_dropped;

#define BUF_BYTES (8u << 20)

static void CUPTIAPI buf_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = (uint8_t *)aligned_alloc(8, BUF_BYTES);
  *size = *buffer ? BUF_BYTES : 0;
  *max_records = 0;
}

static trace_rec *next_rec(void) {
  if (g_n == g_cap) {
    g_dropped++;
    return NULL;
  }
  return &g_recs[g_n++];
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                   size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *a = NULL;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    trace_rec *r;
    if (a->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || a->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)a;
      if (!(r = next_rec())) continue;
      *r = (trace_rec){.start = k->start, .end = k->end, .node = k->graphNodeId,
                       .graph = k->graphId, .stream = k->streamId,
                       .grid = (uint32_t)(k->gridX * k->gridY * k->gridZ),
                       .block = (uint32_t)(k->blockX * k->blockY * k->blockZ),
                       .name = k->name, .kind = 'K'};
    } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)a;
      if (!(r = next_rec())) continue;
      *r = (trace_rec){.start = m->start, .end = m->end, .node = m->graphNodeId,
                       .graph = m->graphId, .stream = m->streamId, .name = "memcpy",
                       .kind = 'C', .copy_kind = m->copyKind, .bytes = m->bytes};
    } else if (a->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const CUpti_ActivityAPI *api = (const CUpti_ActivityAPI *)a;
      if (!(r = next_rec())) continue;
      const char *nm = NULL;
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, api->cbid, &nm);
      *r = (trace_rec){.start = api->start, .end = api->end, .stream = api->threadId,
                       .name = nm ? nm : "?", .kind = 'R'};
    } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)a;
      if (!(r = next_rec())) continue;
      *r = (trace_rec){.start = m->start, .end = m->end, .node = m->graphNodeId,
                       .graph = m->graphId, .stream = m->streamId, .name = "memset",
                       .kind = 'S', .bytes = m->bytes};
    }
  }
  free(buffer);
}

static int by_start(const void *a, const void *b) {
  const trace_rec *x = a, *y = b;
  return x->start < y->start ? -1 : x->start > y->start;
}

static const char *copy_kind_name(uint8_t k) {
  switch (k) {
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
  default: return "other";
  }
}

static void write_trace(void) {
  if (cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != CUPTI_SUCCESS)
    fprintf(stderr, "pd-cupti-trace: cuptiActivityFlushAll failed: the last records may be lost\n");
  const char *path = getenv("PD_TRACE_OUT");
  FILE *f = path && *path ? fopen(path, "w") : stderr;
  if (!f) {
    fprintf(stderr, "pd-cupti-trace: cannot open %s\n", path);
    return;
  }
  qsort(g_recs, g_n, sizeof *g_recs, by_start);
  uint64_t t0 = g_n ? g_recs[0].start : 0;
  for (size_t i = 0; i < g_n; i++) {
    const trace_rec *r = &g_recs[i];
    char name[64];
    const char *nm = r->name ? r->name : "?";
    if (r->kind == 'C') {
      snprintf(name, sizeof name, "memcpy%s:%" PRIu64, copy_kind_name(r->copy_kind), r->bytes);
      nm = name;
    } else if (r->kind == 'S') {
      snprintf(name, sizeof name, "memset:%" PRIu64, r->bytes);
      nm = name;
    }
    fprintf(f, "%" PRIu64 "\t%" PRIu64 "\t%c\t%u\t%" PRIu64 "\t%u\t%u\t%u\t%s\n", r->start - t0,
            r->end - r->start, r->kind, r->graph, r->node, r->stream, r->grid, r->block, nm);
  }
  if (g_dropped) fprintf(stderr, "pd-cupti-trace: %zu records dropped (PD_TRACE_MAX)\n", g_dropped);
  fprintf(stderr, "pd-cupti-trace: %zu records -> %s\n", g_n, path && *path ? path : "stderr");
  if (f != stderr) fclose(f);
}

static int enable(CUpti_ActivityKind k) {
  CUptiResult rc = cuptiActivityEnable(k);
  if (rc != CUPTI_SUCCESS) {
    const char *msg = NULL;
    cuptiGetResultString(rc, &msg);
    fprintf(stderr, "pd-cupti-trace: cuptiActivityEnable(%d): %s\n", (int)k, msg ? msg : "?");
    return -1;
  }
  return 0;
}

/* Called by the CUDA driver when it loads this library (CUDA_INJECTION64_PATH). */
int InitializeInjection(void) {
  const char *m = getenv("PD_TRACE_MAX");
  g_cap = m && *m ? (size_t)strtoull(m, NULL, 10) : (size_t)4 << 20;
  g_recs = calloc(g_cap ? g_cap : 1, sizeof *g_recs);
  if (!g_recs) {
    fprintf(stderr, "pd-cupti-trace: out of memory for %zu records\n", g_cap);
    return 0;
  }
  if (cuptiActivityRegisterCallbacks(buf_requested, buf_completed) != CUPTI_SUCCESS) {
    fprintf(stderr, "pd-cupti-trace: cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  if (enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) || enable(CUPTI_ACTIVITY_KIND_MEMCPY) ||
      enable(CUPTI_ACTIVITY_KIND_MEMSET))
    return 0;
  const char *api = getenv("PD_TRACE_API");
  if (api && atoi(api) > 0 && enable(CUPTI_ACTIVITY_KIND_RUNTIME)) return 0;
  atexit(write_trace);
  return 1;
}
