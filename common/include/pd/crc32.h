/* CRC-32 (the zlib / IEEE 802.3 polynomial, bit-reflected) of the KV transfers' payloads.
 *
 * pd_crc32(crc, buf, len) returns what zlib's crc32(crc, buf, len) returns (start from 0, chain
 * by passing the previous result), computed by carry-less multiplication (PCLMULQDQ folding,
 * four 16-byte lanes) on x86-64 CPUs that have it, by zlib otherwise and for the last bytes. */
#ifndef PD_CRC32_H
#define PD_CRC32_H

#include <stddef.h>
#include <stdint.h>

uint32_t pd_crc32(uint32_t crc, const void *buf, size_t len);

/* Whether pd_crc32 takes the carry-less multiplication path on this CPU. */
int pd_crc32_accelerated(void);

#endif
