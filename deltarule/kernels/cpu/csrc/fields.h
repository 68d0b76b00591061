/* A struct's field table, exported so that the Python binding (kernels/cpu/layout.py), which
 * generates its packing of the struct from a table of its own, compares every field's offset and
 * size with the compiler's when the library loads: a field moved, added or retyped on one side
 * only is an ImportError, never a misread struct. */
#ifndef DELTARULE_FIELDS_H
#define DELTARULE_FIELDS_H

#include <stddef.h>

typedef struct {
    const char *name;               /* NULL ends a table */
    size_t offset, size;
} field;

#define FIELD(type, name) {#name, offsetof(type, name), sizeof(((type *)0)->name)}

#endif
