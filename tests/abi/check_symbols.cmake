# Exported dynamic symbols of libminikv.so must be exactly the minikv_* contract: the 15
# functions DESIGN.md names, which must also be the MINIKV_API declarations of the header.
#   cmake -DLIB=<libminikv.so> -DHEADER=<minikv.h> -DNM=<nm> -P check_symbols.cmake
set(contract
  minikv_append minikv_cache_create minikv_cache_destroy minikv_cache_last_error
  minikv_config_default minikv_decode minikv_kept_positions minikv_last_error_message
  minikv_memory_stats_get minikv_prefill minikv_sequence_length minikv_sequence_release
  minikv_status_string minikv_version_number minikv_version_string)
list(SORT contract)

execute_process(COMMAND "${NM}" -D --defined-only "${LIB}"
                OUTPUT_VARIABLE nm_out RESULT_VARIABLE rc ERROR_VARIABLE nm_err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIB} failed: ${nm_err}")
endif()
string(REPLACE "\n" ";" lines "${nm_out}")
set(exported)
foreach(line IN LISTS lines)
  # "<address> <type> <name>[@version]"; absolute (A) entries are version nodes.
  if(line MATCHES "^[0-9a-fA-F]* *([A-Za-z]) ([^ @]+)")
    if(NOT CMAKE_MATCH_1 STREQUAL "A")
      list(APPEND exported "${CMAKE_MATCH_2}")
    endif()
  endif()
endforeach()
list(SORT exported)

file(READ "${HEADER}" header)
string(REGEX MATCHALL "MINIKV_API[^;(]*[ *](minikv_[a-z0-9_]+) *\\(" decls "${header}")
set(declared)
foreach(d IN LISTS decls)
  string(REGEX MATCH "(minikv_[a-z0-9_]+) *\\($" _ "${d}")
  list(APPEND declared "${CMAKE_MATCH_1}")
endforeach()
list(SORT declared)

set(ok TRUE)
if(NOT exported STREQUAL contract)
  set(extra ${exported})
  list(REMOVE_ITEM extra ${contract})
  set(missing ${contract})
  list(REMOVE_ITEM missing ${exported})
  message(SEND_ERROR "exported symbols differ from the contract\n  extra: ${extra}\n  missing: ${missing}")
  set(ok FALSE)
endif()
if(NOT declared STREQUAL contract)
  message(SEND_ERROR "MINIKV_API declarations of ${HEADER} differ from the contract:\n  ${declared}")
  set(ok FALSE)
endif()
list(LENGTH exported n)
if(ok)
  message(STATUS "libminikv exports exactly the ${n} minikv_* functions of the contract")
endif()
